"""Does the planner pick the plan that runs fastest? Its candidates on this CPU, each predicted and then measured.

    python benchmarks/plan_check.py --output_dir outputs/plan_check
    python benchmarks/plan_check.py --output_dir outputs/plan_check --steps 60 --micro_batches 8 16

The planner (`async_rlhf/plan`) searches the built-in online DPO workload (32 prompts x 2 samples a step, prompts of
26 tokens, responses of mean 5, cv 0.3, at most 24; the 1.2M-parameter reward model) on the shipped `cpu` profile
with 2 devices (one core per process): one learner and one generator, `max_staleness` 0..4 at the fastest
micro-batch, plus, for `max_staleness` 1, the micro-batches named by `--micro_batches` (the search keeps the fastest
learner set-up per split; these are the ones it dropped). Each candidate's command, exactly as the planner prints it,
runs for `--steps` steps (16 evaluation prompts), one after the other (`--rounds` times round by round, the fastest
round counting); measured step time = training loop seconds /
steps from its `run_summary.json`. Printed: predicted and measured step time per candidate, their ranks, and
whether the planner's pick is the measured best under the planner's own rule (the fastest; within `TIE` = 3% of it
the smaller `max_staleness`). On a shared machine run it under the benchmark lock:
`flock /tmp/async_rlhf_bench.lock python benchmarks/plan_check.py ...`; each row records the load before it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from async_rlhf.plan import search as sr  # noqa: E402
from async_rlhf.plan.commands import describe, launch_command  # noqa: E402
from async_rlhf.plan.cost_model import Workload  # noqa: E402
from async_rlhf.plan.hardware import get_profile  # noqa: E402
from async_rlhf.plan.model_shapes import parse_size, resolve_model  # noqa: E402

WORKLOAD = dict(prompts_per_step=32, n=2, prompt_tokens=26, response_mean=5, response_cv=0.3, response_max=24,
                reward_params=parse_size("1.2M"))


def candidates(model: str, micro_batches: list[int]) -> tuple[list[sr.Evaluated], sr.Evaluated]:
    """The planner's plans for the built-in workload on the cpu profile, and its pick."""
    shape, dev, w = resolve_model(model, None), get_profile("cpu"), Workload(**WORKLOAD)
    plans = sr.search(shape, dev, w, gpus=2)
    pick = sr.best(plans)
    for mb in micro_batches:
        if mb != pick.plan.micro_batch:
            plans += sr.evaluate_split(shape, dev, w, 1, 1, 1, 1, staleness=[1], micro_batch=mb)
    return sorted(plans, key=sr.rank_key), pick


def measured_best(rows: list[dict]) -> dict:
    """The planner's rule applied to measured times: the fastest, or within TIE of it the smallest staleness."""
    fastest = min(r["measured"] for r in rows)
    near = [r for r in rows if r["measured"] <= fastest * (1 + sr.TIE)]
    return min(near, key=lambda r: (r["staleness"], r["measured"]))


def run(e: sr.Evaluated, steps: int, out: str, timeout: float) -> dict:
    cmd = shlex.split(launch_command(e.plan, Workload(**WORKLOAD), cpu=True, output_dir=out))
    cmd = [sys.executable if c == "python" else c for c in cmd] + ["--max_steps", str(steps), "--eval_prompts", "16"]
    load = os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.exit(f"{describe(e.plan)}: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "run_summary.json")) as f:
        s = json.load(f)
    return {"plan": describe(e.plan), "staleness": e.plan.max_staleness, "predicted": e.step_seconds,
            "measured": s["loop_seconds"] / s["steps"], "load_1min": load}


def table(rows: list[dict], pick: str) -> str:
    by_pred = sorted(rows, key=lambda r: (round(r["predicted"], 6), r["staleness"]))
    by_meas = sorted(rows, key=lambda r: r["measured"])
    lines = ["| plan | load before | predicted s/step (rank) | measured s/step (rank) |", "| --- | --- | --- | --- |"]
    for r in by_pred:
        mark = " (planner's pick)" if r["plan"] == pick else ""
        lines.append(f"| {r['plan']}{mark} | {r['load_1min']:.2f} | {r['predicted']:.3f} ({by_pred.index(r) + 1}) | "
                     f"{r['measured']:.3f} ({by_meas.index(r) + 1}) |")
    best = measured_best(rows)
    chosen = next(r for r in rows if r["plan"] == pick)
    verdict = ("the planner's pick is the measured best" if best["plan"] == pick else
               f"the measured best is {best['plan']} ({best['measured']:.3f} s/step); the planner's pick measured "
               f"{chosen['measured'] / best['measured'] - 1:+.1%} against it")
    lines.append(f"\n{verdict} (rule: fastest, within {sr.TIE:.0%} of it the smaller max_staleness; fastest measured: "
                 f"{by_meas[0]['plan']} {by_meas[0]['measured']:.3f} s/step)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--model", default=os.path.expanduser("~/.cache/async_rlhf/builtin-v5/sft_model"),
                   help="the policy whose config.json the planner reads (default: the built-in task's)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro_batches", type=int, nargs="*", default=[16],
                   help="extra micro-batches run at max_staleness 1 besides the planner's fastest")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every candidate this many times, round by round; its fastest round counts (on a shared "
                        "machine other load only ever slows a run down)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = p.parse_args(argv)
    if args.steps < 4 or args.rounds < 1:
        p.error(f"--steps: at least 4, got {args.steps}; --rounds: at least 1, got {args.rounds}")
    if any(mb < 1 or WORKLOAD["prompts_per_step"] % mb for mb in args.micro_batches):
        p.error(f"--micro_batches: each must divide {WORKLOAD['prompts_per_step']} prompts, got {args.micro_batches}")
    plans, pick = candidates(args.model, args.micro_batches)
    os.makedirs(args.output_dir, exist_ok=True)
    best_of: dict[str, dict] = {}
    for round_ in range(args.rounds):
        for e in plans:
            t0 = time.perf_counter()
            name = describe(e.plan)
            r = run(e, args.steps, os.path.join(args.output_dir, f"{name.replace('/', '_').replace(' ', '_')}_{round_}"),
                    args.timeout)
            if name not in best_of or r["measured"] < best_of[name]["measured"]:
                best_of[name] = r
            print(f"round {round_ + 1}, {name}: predicted {e.step_seconds:.3f} s/step, measured {r['measured']:.3f} "
                  f"(load {r['load_1min']:.2f}); {time.perf_counter() - t0:.0f} s", flush=True)
    rows = list(best_of.values())
    with open(os.path.join(args.output_dir, "plan_check.json"), "w") as f:
        json.dump({"pick": describe(pick.plan), "rows": rows}, f, indent=1)
    print(table(rows, describe(pick.plan)))


if __name__ == "__main__":
    main()
