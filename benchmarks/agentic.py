"""Multi-turn GRPO with a slow tool: our asynchronous trainer (max_staleness 0, 1, 2) against TRL 1.16's GRPOTrainer
with the same `environment_factory`, on the guessing task (docs/guess_task.md), with a latency injected into every
tool call.

    python benchmarks/agentic.py --quick                       # latency 0.2 s, 1 seed, 8 steps: a smoke run
    python benchmarks/agentic.py --latencies 0 0.05 0.2 --seeds 0 --steps 12
    python benchmarks/agentic.py --to_threshold --trainers ours trl --seeds 0  # time to held-out success 0.9
    python benchmarks/agentic.py --summarize outputs/agentic  # those runs' table: x TRL per seed, geometric means

Both trainers start from the task's SFT policy, train with the same GRPO settings (`launch/configs/grpo_guess.yaml`'s
learning rate, beta 0, episodes of up to 5 rounds in 256 ids) on `--prompts` prompts x 8 episodes a step, and the
environment is `LatencyGuessEnv`: `GuessEnv` whose `guess` sleeps `AGENTIC_TOOL_LATENCY` seconds first (a remote
service, a sandbox). TRL (synchronous, one process with every core) runs each call in turn inside its training step;
ours runs episodes in a generator process, the calls of a round at once, while the learner trains on the previous
batch (S >= 1). Each run is a child process; its clock runs from before the trainer is built to the end of `train()`
(model loading and our generator's start included). After training, the policy is evaluated on `--eval_episodes`
held-out episodes (success rate; off the clock).

Confounds, named: ours overlaps two things TRL does in sequence, the tool calls of one round (concurrency) and
generation with training (asynchrony); `S=0` separates them (concurrent calls, no overlap of steps). TRL's GRPO is
on-policy; ours at S >= 1 trains on samples one step old (its off-policy correction on). The success rate after so
few steps carries sampling noise of about 0.5/sqrt(episodes).

`--to_threshold` runs the setting that reaches 0.9 (evals/results/guess_grpo) for up to 240 steps, evaluates the
learner's current policy on 256 held-out episodes every 10 steps (off the clock) and stops at the first evaluation
at or above 0.9: the time to that success, with the tool calls made until then (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
for path in (ROOT, HERE):
    if path not in sys.path:
        sys.path.insert(0, path)

from transformers import TrainerCallback  # noqa: E402

from async_rlhf.data.guess_task import GuessEnv  # noqa: E402

LATENCY_ENV = "AGENTIC_TOOL_LATENCY"
CHILD_OPTIONS = ("steps", "prompts", "generations", "learning_rate", "lr_scheduler_type", "warmup_steps", "sft_steps",
                 "eval_episodes", "eval_every", "threshold")  # passed from the parent to each child run


class LatencyGuessEnv(GuessEnv):
    """`GuessEnv` with `AGENTIC_TOOL_LATENCY` seconds of waiting in every call (read at each call, so the generator
    processes, which inherit the variable, wait as long)."""

    def guess(self, n: int) -> str:
        time.sleep(float(os.environ.get(LATENCY_ENV, "0")))
        return super().guess(n)

    guess.__doc__ = GuessEnv.guess.__doc__  # the tool schema (and so the prompt) the policy was trained and is
    # evaluated with: a docstring of its own would change the system block the policy sees in training only


# ---- a child: one training run --------------------------------------------------------------------------------------
def child(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentic import LatencyGuessEnv as Env  # by module name, so generator processes can unpickle the factory
    from async_rlhf.data import guess_task
    from async_rlhf.tasks.build_guess import prepare_guess
    from async_rlhf.tasks.guess_evaluation import evaluate_guess_policy

    paths = prepare_guess(seed=0, sft_steps=args.sft_steps)
    episodes_per_step = args.prompts * args.generations
    dataset = guess_task.make_split(args.prompts * args.steps * 2, args.seed, "train")
    fields = dict(output_dir=args.output_dir, per_device_train_batch_size=episodes_per_step,
                  num_generations=args.generations, max_completion_length=256, max_tool_calling_iterations=5,
                  learning_rate=args.learning_rate, lr_scheduler_type=args.lr_scheduler_type,
                  warmup_steps=args.warmup_steps, beta=0.0, max_steps=args.steps, logging_steps=1, report_to="none",
                  seed=args.seed, save_strategy="no", bf16=False)
    t0 = time.perf_counter()
    if args.trainer == "trl":
        os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
        from trl import GRPOConfig, GRPOTrainer

        config = GRPOConfig(**fields, use_cpu=True, disable_tqdm=True)
    else:
        from async_rlhf import AsyncGRPOConfig as GRPOConfig
        from async_rlhf import AsyncGRPOTrainer as GRPOTrainer

        config = GRPOConfig(**fields, max_staleness=args.max_staleness, generator_backend="transformers",
                            disable_tqdm=True, rollout_timeout=1800)
    trainer = GRPOTrainer(model=paths["sft_model"], args=config, train_dataset=dataset, environment_factory=Env,
                          processing_class=AutoTokenizer.from_pretrained(paths["sft_model"]))
    curve = HeldOutCurve(trainer, AutoTokenizer.from_pretrained(paths["tokenizer"]), args, t0)
    if args.eval_every:
        trainer.add_callback(curve)
    trainer.train()
    clock = time.perf_counter() - t0 - curve.seconds
    logs = [h for h in trainer.state.log_history if "reward" in h]
    steps = trainer.state.global_step
    model = trainer.accelerator.unwrap_model(trainer.model)
    policy = AutoModelForCausalLM.from_pretrained(paths["sft_model"])
    policy.load_state_dict({k: v.detach().cpu().float() for k, v in model.state_dict().items()})
    torch.manual_seed(0)
    held_out = evaluate_guess_policy(policy, AutoTokenizer.from_pretrained(paths["tokenizer"]), "guess",
                                     args.eval_episodes, seed=0)
    calls = sum(h.get("tools/call_frequency", 0) for h in logs) / max(1, len(logs))
    return {"trainer": args.trainer, "max_staleness": args.max_staleness if args.trainer == "ours" else None,
            "latency": float(os.environ.get(LATENCY_ENV, "0")), "seed": args.seed, "steps": steps,
            "episodes": steps * episodes_per_step, "clock_seconds": clock,
            "episodes_per_s": steps * episodes_per_step / clock,
            "train_reward_first": logs[0]["reward"] if logs else None,
            "train_reward_last": logs[-1]["reward"] if logs else None,
            "tool_calls_per_episode": calls, "tool_calls": calls * steps * episodes_per_step,
            "held_out_success": held_out["success_rate"], "held_out_turns": held_out["turns_mean"],
            "held_out_curve": curve.points, "threshold": args.threshold, **curve.reached()}


class HeldOutCurve(TrainerCallback):
    """Every `eval_every` optimizer steps, the learner's current policy plays `eval_episodes` held-out episodes
    (seed 0, temperature 1, as the task's final evaluation); the evaluation's seconds are taken off the clock. With a
    `threshold`, training stops at the first evaluation at or above it, and `reached()` gives the clock, the steps
    and the tool calls made until then."""

    def __init__(self, trainer, tokenizer, args, t0: float):
        self.trainer, self.tokenizer, self.args, self.t0 = trainer, tokenizer, args, t0
        self.seconds = 0.0  # evaluations, off the clock
        self.points: list[dict] = []

    def on_step_end(self, args, state, control, **kwargs):
        import torch

        from async_rlhf.tasks.guess_evaluation import evaluate_guess_policy

        if state.global_step % self.args.eval_every:
            return
        clock = time.perf_counter() - self.t0 - self.seconds
        start = time.perf_counter()
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        was_training = model.training
        rng = torch.get_rng_state()
        try:
            model.eval()
            metrics = evaluate_guess_policy(model, self.tokenizer, "guess", self.args.eval_episodes, seed=0)
        finally:
            model.train(was_training)
            torch.set_rng_state(rng)  # the training's own sampling is not moved by the evaluation's
        self.seconds += time.perf_counter() - start
        calls = [h.get("tools/call_frequency", 0) for h in state.log_history if "reward" in h]
        self.points.append({"step": state.global_step, "clock_seconds": clock,
                            "tool_calls": sum(calls) * self.args.prompts * self.args.generations,
                            "success": metrics["success_rate"]})
        print(f"[agentic] step {state.global_step}: held-out success {metrics['success_rate']:.3f} at "
              f"{clock:.1f} s", flush=True)
        if self.args.threshold is not None and metrics["success_rate"] >= self.args.threshold:
            control.should_training_stop = True

    def reached(self) -> dict:
        hit = next((p for p in self.points if self.args.threshold is not None
                    and p["success"] >= self.args.threshold), None)
        return {"threshold_step": hit and hit["step"], "threshold_clock_seconds": hit and hit["clock_seconds"],
                "threshold_tool_calls": hit and hit["tool_calls"]}


# ---- the parent ---------------------------------------------------------------------------------------------------
def run_child(trainer: str, latency: float, seed: int, staleness: int, args, out_dir: str) -> dict | None:
    name = f"{trainer}{'' if trainer == 'trl' else f'-s{staleness}'}-lat{latency:g}-seed{seed}"
    path = os.path.join(out_dir, name + ".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--trainer", trainer, "--seed", str(seed),
           "--max_staleness", str(staleness), "--output_dir", os.path.join(out_dir, name), "--json", path]
    for option in CHILD_OPTIONS:
        value = getattr(args, option)
        if value is not None:
            cmd += [f"--{option}", str(value)]
    env = {**os.environ, LATENCY_ENV: str(latency), "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    print(f"[agentic] {name} ...", flush=True)
    with open(os.path.join(out_dir, name + ".log"), "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout)
    if proc.returncode != 0:
        print(f"[agentic] {name}: exit {proc.returncode}, see {log.name}", flush=True)
        return None
    result = json.load(open(path))
    print(f"[agentic] {name}: {result['clock_seconds']:.1f} s, {result['episodes_per_s']:.2f} episodes/s, "
          f"held-out success {result['held_out_success']:.3f}", flush=True)
    return result


def threshold_table(results: list[dict]) -> str:
    """Time to the held-out threshold (evaluations off the clock), each trainer at the latency it ran with, with the
    tool calls made until then (what a latency per call would add to a trainer that makes them one after the other,
    as TRL's `_tool_call_loop` does)."""
    rows = ["| trainer | latency s (ran) | seed | steps | episodes | tool calls | held-out success | clock s to it |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(results, key=lambda r: (r["seed"], r["trainer"] != "trl", r["latency"])):
        if r.get("threshold") is None:
            continue
        label = "TRL GRPOTrainer" if r["trainer"] == "trl" else f"ours, S={r['max_staleness']}"
        hit = r["threshold_step"] is not None
        best = max((p["success"] for p in r["held_out_curve"]), default=float("nan"))
        rows.append(f"| {label} | {r['latency']:g} | {r['seed']} | {r['threshold_step'] if hit else r['steps']} | "
                    f"{(r['threshold_step'] or r['steps']) * r['episodes'] // max(1, r['steps'])} | "
                    f"{r['threshold_tool_calls'] if hit else r['tool_calls']:.0f} | "
                    f"{'>= ' + format(r['threshold'], 'g') if hit else f'not reached (best {best:.3f})'} | "
                    f"{r['threshold_clock_seconds'] if hit else float('nan'):.1f} |")
    return "\n".join(rows)


def summarize(dirs: list[str]) -> str:
    """Time to the threshold from the child results (`*.json`) of `--to_threshold` runs in `dirs`: each of ours
    against TRL's at the same seed, where TRL ran at that latency, else against TRL's lower bound there: its clock
    without latency plus latency x its calls to the threshold (its `_tool_call_loop` makes them one after the other,
    so they cannot take less; the same seed makes the same calls at any latency). Per seed, then the geometric mean
    of the ratios with a 95% t-interval over seeds."""
    runs = {}
    for d in dirs:
        if not os.path.isdir(d):
            raise SystemExit(f"--summarize: {d} is not a directory of --to_threshold runs (their --output_dir)")
        for name in sorted(os.listdir(d)):
            if name.endswith(".json") and name != "results.json":
                r = json.load(open(os.path.join(d, name)))
                if r.get("threshold_step") is not None:
                    runs[(r["trainer"], r["max_staleness"], r["latency"], r["seed"])] = r  # a later dir wins
    trl = {(lat, seed): r for (trainer, _, lat, seed), r in runs.items() if trainer == "trl"}
    rows = ["| ours | latency s | seed | steps to it | ours s | TRL s | TRL measured or bound | x TRL |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    ratios: dict = {}
    for (trainer, stale, lat, seed), r in sorted(runs.items(), key=lambda kv: (kv[0][2], kv[0][1] or 0, kv[0][3])):
        if trainer != "ours":
            continue
        peer = trl.get((lat, seed))
        how = "measured"
        if peer is not None:
            trl_s = peer["threshold_clock_seconds"]
        elif (0.0, seed) in trl:
            base = trl[(0.0, seed)]
            trl_s, how = base["threshold_clock_seconds"] + lat * base["threshold_tool_calls"], "bound"
        else:
            continue
        ratio = trl_s / r["threshold_clock_seconds"]
        ratios.setdefault((stale, lat), []).append(ratio)
        rows.append(f"| S={stale} | {lat:g} | {seed} | {r['threshold_step']} | {r['threshold_clock_seconds']:.1f} | "
                    f"{trl_s:,.1f} | {how} | {ratio:.2f} |")
    sync = {}  # asynchrony: ours at S >= 1 against ours at S = 0, same latency and seed
    for (trainer, stale, lat, seed), r in runs.items():
        base = runs.get(("ours", 0, lat, seed))
        if trainer == "ours" and stale and base is not None:
            sync.setdefault((stale, lat), []).append(base["threshold_clock_seconds"] / r["threshold_clock_seconds"])
    rows += ["", "| ours | latency s | x TRL, geometric mean [95% t] | x ours at S=0 |", "| --- | ---: | --- | --- |"]
    for (stale, lat), values in sorted(ratios.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        against_sync = _geometric(sync[(stale, lat)]) if (stale, lat) in sync else ""
        rows.append(f"| S={stale} | {lat:g} | {_geometric(values)} | {against_sync} |")
    return "\n".join(rows)


def _geometric(values: list[float]) -> str:
    """The geometric mean of ratios, with a 95% t-interval (on their logs) when there are several; their count."""
    logs = [math.log(v) for v in values]
    mean = sum(logs) / len(logs)
    if len(logs) == 1:
        return f"{math.exp(mean):.2f} (1 seed)"
    from scipy import stats

    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    half = stats.t.ppf(0.975, len(logs) - 1) * sd / math.sqrt(len(logs))
    return f"{math.exp(mean):.2f} [{math.exp(mean - half):.2f}, {math.exp(mean + half):.2f}] ({len(logs)} seeds)"


def table(results: list[dict]) -> str:
    rows = ["| latency s | trainer | seed | clock s | episodes/s | x TRL's episodes/s | train reward first -> last | "
            "held-out success |", "| ---: | --- | ---: | ---: | ---: | ---: | --- | ---: |"]
    trl = {(r["latency"], r["seed"]): r for r in results if r["trainer"] == "trl"}
    for r in sorted(results, key=lambda r: (r["latency"], r["seed"], r["trainer"] != "trl", r["max_staleness"] or 0)):
        peer = trl.get((r["latency"], r["seed"]))
        ratio = f"{r['episodes_per_s'] / peer['episodes_per_s']:.2f}" if peer and r["trainer"] == "ours" else ""
        label = "TRL GRPOTrainer" if r["trainer"] == "trl" else f"ours, S={r['max_staleness']}"
        rows.append(f"| {r['latency']:g} | {label} | {r['seed']} | {r['clock_seconds']:.1f} | "
                    f"{r['episodes_per_s']:.2f} | {ratio} | {r['train_reward_first']:.3f} -> "
                    f"{r['train_reward_last']:.3f} | {r['held_out_success']:.3f} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--latencies", type=float, nargs="+", default=None,
                   help="seconds a tool call waits (default: 0 0.05 0.2; with --to_threshold: 0)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--staleness", type=int, nargs="+", default=None,
                   help="ours: max_staleness values (default: 0 1 2; with --to_threshold: 1)")
    p.add_argument("--trainers", nargs="+", default=["trl", "ours"], choices=["trl", "ours"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=4, help="prompts a step (x --generations episodes)")
    p.add_argument("--generations", type=int, default=8, help="episodes a prompt (GRPO's group)")
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--lr_scheduler_type", default="constant")
    p.add_argument("--warmup_steps", type=float, default=0.0, help="steps, or a fraction of them below 1")
    p.add_argument("--sft_steps", type=int, default=600, help="the task's SFT policy (tasks/build_guess.py)")
    p.add_argument("--eval_episodes", type=int, default=128)
    p.add_argument("--eval_every", type=int, default=0, help="held-out evaluation every this many steps (0: end only)")
    p.add_argument("--threshold", type=float, default=None, help="stop at the first evaluation at or above it")
    p.add_argument("--to_threshold", action="store_true",
                   help="time to held-out success 0.9: evals/results/guess_grpo's s01 setting (16 prompts x 16 "
                        "episodes, lr 3e-4 cosine, warm-up 0.1, the 1200-step SFT policy), up to 240 steps, 256 "
                        "held-out episodes every 10 steps, S=1 and latency 0 unless given")
    p.add_argument("--summarize", nargs="+", metavar="DIR", default=None,
                   help="print the time-to-threshold table of earlier --to_threshold output dirs (no runs)")
    p.add_argument("--run_timeout", type=float, default=1800.0)
    p.add_argument("--output_dir", default="outputs/agentic")
    p.add_argument("--quick", action="store_true", help="latency 0.2, seed 0, S=1, 8 steps, 64 held-out episodes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trainer", default="ours", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max_staleness", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.summarize:
        print(summarize(args.summarize))
        return None
    if args.child:
        result = child(args)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        return result
    if args.quick:
        args.latencies, args.seeds, args.staleness, args.steps, args.eval_episodes = [0.2], [0], [1], 8, 64
    if args.to_threshold:
        args.latencies = args.latencies or [0.0]
        args.staleness = args.staleness or [1]
        args.steps, args.prompts, args.generations = 240, 16, 16
        args.learning_rate, args.lr_scheduler_type, args.warmup_steps, args.sft_steps = 3e-4, "cosine", 0.1, 1200
        args.eval_episodes, args.eval_every, args.threshold = 256, 10, 0.9
    args.latencies = args.latencies or [0.0, 0.05, 0.2]
    args.staleness = args.staleness if args.staleness is not None else [0, 1, 2]
    out_dir = os.path.abspath(args.output_dir)
    os.makedirs(out_dir, exist_ok=True)
    results = []
    for latency in args.latencies:
        for seed in args.seeds:
            for trainer in args.trainers:
                for staleness in (args.staleness if trainer == "ours" else [0]):
                    r = run_child(trainer, latency, seed, staleness, args, out_dir)
                    if r is not None:
                        results.append(r)
    machine = f"{platform.machine()}, {os.cpu_count()} cores, load {' '.join(open('/proc/loadavg').read().split()[:3])}"
    report = {"machine": machine, "settings": {k: v for k, v in vars(args).items() if k not in ("child", "json")},
              "results": results}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(report, f, indent=1)
    print(f"\n{machine}\n" + table(results))
    if args.threshold is not None:
        print("\n" + threshold_table(results))
    return report


if __name__ == "__main__":
    main()
