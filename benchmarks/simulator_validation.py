"""The simulator against measured runs: predicted vs measured step time of the built-in online DPO recipe.

    python benchmarks/simulator_validation.py --output_dir outputs/simulator_validation
    python benchmarks/simulator_validation.py --output_dir outputs/simulator_validation --table_only

Runs `recipes/online_dpo.py` (built-in task, 32 prompts x 2 samples a step, `--steps` steps, 16 evaluation prompts) in
each configuration of CONFIGS, one after the other, as subprocesses; reads each run's `run_summary.json`; feeds the
simulator (`async_rlhf/plan/feedback.py::inputs_from_summary`) with that run's own stage times (learner time per
step, sync and load per sync, sampling cost per token over the run's completion lengths, hand-off and transit per
batch) and compares its predicted step time with the measured one (training loop seconds / steps). The "overlap
formula" column is the README's rule of thumb (S = 0: generation + training; S >= 1: the larger of the two, with
generation taken as the measured dispatch-to-queued latency) for comparison. Each row records the 1-minute load
average before its run, and a run in which a generator was restarted says so (the simulator does not model
restarts). `--table_only` rebuilds the table from `validation.jsonl` in `--output_dir`.
On a shared machine, run it under the benchmark lock: `flock /tmp/async_rlhf_bench.lock python ...`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# (name, max_staleness, generators, learner ranks, extra recipe flags)
CONFIGS = [
    ("S0, 1 gen, 1 learner", 0, 1, 1, []),
    ("S1, 1 gen, 1 learner", 1, 1, 1, []),
    ("S4, 1 gen, 1 learner", 4, 1, 1, []),
    ("S0, 2 gen, 1 learner", 0, 2, 1, []),
    ("S1, 2 gen, 1 learner", 1, 2, 1, []),
    ("S1, 1 gen, 2 learners", 1, 1, 2, []),
    ("S4, 1 gen, 2 learners", 4, 1, 2, []),
    ("S1, 1 gen, 1 learner, batch-level", 1, 1, 1, ["--generation_mode", "batch"]),
]
PROMPTS_PER_STEP, N = 32, 2


def command(staleness: int, generators: int, learners: int, extra: list[str], steps: int, out: str) -> list[str]:
    flags = ["--max_steps", str(steps), "--eval_prompts", "16", "--max_staleness", str(staleness),
             "--generator_devices", *["cpu"] * generators, "--per_device_train_batch_size",
             str(PROMPTS_PER_STEP // learners), "--output_dir", out, *extra]
    if learners == 1:
        return [sys.executable, "recipes/online_dpo.py", *flags]
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or "accelerate"
    return [accelerate, "launch", "--config_file", "launch/accelerate/cpu_2proc_gloo.yaml", "recipes/online_dpo.py",
            *flags]


def overlap_formula(s: dict) -> float:
    steps = s["steps"]
    latency = s["rollout_latency_seconds"] / max(1, s["timed_batches"])
    train = s["train_seconds"] / steps
    return latency + train if s["max_staleness"] == 0 else max(latency, train)


def row(name: str, load: float, s: dict) -> dict:
    from async_rlhf.plan.feedback import inputs_from_summary, predict

    cfg = inputs_from_summary(s, PROMPTS_PER_STEP, N)
    measured = s["loop_seconds"] / s["steps"]
    predicted = predict(cfg)
    return {"config": name, "load_1min": load, "measured": measured, "predicted": predicted,
            "error": predicted / measured - 1, "formula": overlap_formula(s), "train": cfg.train_seconds,
            "gen_busy": s["generator_busy_seconds"] / s["steps"], "handoff": cfg.handoff_seconds,
            "transit": cfg.dispatch_seconds, "score": cfg.score_seconds, "restarts": s.get("generator_restarts", 0)}


def table(rows: list[dict]) -> str:
    lines = ["| configuration | load before | measured s/step | simulated s/step | error | overlap formula (error) | "
             "inputs: train s/step, sampling s/batch (all generators), scoring s/part, hand-off s, transit s |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        name = r["config"] + (f" ({r['restarts']} generator restart)" if r.get("restarts") else "")
        lines.append(f"| {name} | {r['load_1min']:.2f} | {r['measured']:.3f} | {r['predicted']:.3f} | "
                     f"{r['error']:+.1%} | {r['formula']:.3f} ({r['formula'] / r['measured'] - 1:+.0%}) | "
                     f"{r['train']:.3f}, {r['gen_busy']:.3f}, {r['score']:.4f}, {r['handoff']:.3f}, {r['transit']:.3f} |")
    errors = [abs(r["error"]) for r in rows]
    if errors:
        lines.append(f"\nmean |error| {sum(errors) / len(errors):.1%}, max {max(errors):.1%} over {len(rows)} runs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--only", nargs="*", help="names (substrings) of the configurations to run; default all")
    p.add_argument("--table_only", action="store_true", help="rebuild the table from OUTPUT_DIR/validation.jsonl")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    args = p.parse_args(argv)
    if args.steps < 4:
        p.error(f"--steps: at least 4, got {args.steps}")
    os.makedirs(args.output_dir, exist_ok=True)
    results = os.path.join(args.output_dir, "validation.jsonl")
    if not args.table_only:
        for name, s, g, l, extra in CONFIGS:
            if args.only and not any(o in name for o in args.only):
                continue
            out = os.path.join(args.output_dir, name.replace(", ", "_").replace(" ", "-"))
            load = os.getloadavg()[0]
            t0 = time.perf_counter()
            proc = subprocess.run(command(s, g, l, extra, args.steps, out), cwd=ROOT, capture_output=True, text=True,
                                  timeout=args.timeout)
            if proc.returncode != 0:
                sys.exit(f"{name}: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            with open(os.path.join(out, "run_summary.json")) as f:
                summary = json.load(f)
            r = row(name, load, summary)
            print(f"{name}: measured {r['measured']:.3f} s/step, simulated {r['predicted']:.3f} ({r['error']:+.1%}); "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            with open(results, "a") as f:
                f.write(json.dumps({**r, "summary": summary}) + "\n")
    with open(results) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = [{**r, **row(r["config"], r["load_1min"], r["summary"])} for r in rows]  # recomputed with today's model
    print(table(rows))


if __name__ == "__main__":
    main()
