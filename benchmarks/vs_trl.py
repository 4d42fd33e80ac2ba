"""TRL 1.16's OnlineDPOTrainer against our asynchronous online DPO on the built-in task: seconds to equal gold win-rate.

    python benchmarks/vs_trl.py --quick                # 1 seed, 40 steps: a smoke run (about 3 minutes on 2 cores)
    python benchmarks/vs_trl.py                        # 3 seeds x 100 steps x both trainers (about 8 minutes)
    python benchmarks/vs_trl.py --variants '' '--generator_backend transformers' '--num_generations 4'
    python benchmarks/vs_trl.py --quick --device cuda  # one GPU: TRL on it; ours colocated there (bf16 both)
    python benchmarks/vs_trl.py --quick --cold         # ours also without the generators' head start (prewarm.py)

Both trainers start from the built-in task's SFT policy, score with its proxy reward model and train on the same
prompts in the same order (our `PromptStream` for the seed; TRL reads the dataset sequentially in that order), with
the settings of `recipes/online_dpo.py --task builtin` (`launch/configs/online_dpo_builtin.yaml`: lr, beta,
max_new_tokens, max_length, temperature, prompts per step, optimizer): TRL's `trl.experimental.online_dpo.OnlineDPOTrainer`
(synchronous: transformers generation, then the reward model, then policy and reference forwards, all in one
process with every core) and ours (one generator process next to one learner process). `--variants` runs ours once
per quoted set of recipe flags (e.g. `--num_generations 4`: TRL always samples 2 per prompt); flags after `--ours`
go to every one of our runs. `--device cuda` runs both on the first GPU in bf16: TRL as usual (everything in one
process), ours with its learner and one transformers-backend generator colocated on that GPU (weights as CUDA IPC
handles; `--generator_backend transformers` because vLLM's CUDA build is not part of this check).

Each run is a child process of this one (so both start cold, and the process wall time is measured from outside).
Every `--eval_every` steps the run's current policy is evaluated on the task's gold win-rate (512 held-out prompts,
greedy); the evaluation's seconds are taken off that run's clock. The clock starts before the trainer is built, so it
holds loading the models and (ours) starting the generator; imports and the task's data set-up are only in the
process wall, and in each run's first optimizer step counted from its process start (both trainers). Our runs start
the generators' fork server first, as the recipes do (`generation/pool/prewarm.py`); `--cold` adds one without it.
Seconds to a win-rate threshold are interpolated linearly between evaluations (step 0 is the SFT policy at 0 s).
Ours keeps generating during an evaluation (max_staleness 1: at most one batch ahead), which the exclusion cannot
take back; the report prints how long our learner waited for rollouts, an upper bound of what that could save.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

TRAINERS = ("trl", "ours")


# ---- children: one training run each ------------------------------------------------------------------------------
def since_process_start() -> float:
    """This process's start (the kernel's), as `time.time()` reads it: what both trainers' start-up is counted from."""
    import psutil

    return psutil.Process().create_time()


def timed_evaluation(trainer, evaluate, every: int, last_step: int, t0: float):
    """A callback that evaluates the policy every `every` steps (and at the last) and records (step, clock, metrics),
    the clock being seconds since `t0` (taken before the trainer was built) minus the evaluations' own seconds."""
    from transformers import TrainerCallback

    class TimedEvaluation(TrainerCallback):
        def __init__(self):
            self.t0 = t0
            self.eval_seconds = 0.0
            self.curve: list[dict] = []
            self.first_step = None  # seconds from process start to the end of the first optimizer step

        def on_step_end(self, args, state, control, **kwargs):
            step = state.global_step
            if self.first_step is None:
                self.first_step = round(time.time() - since_process_start(), 3)
            if step % every and step != last_step:
                return
            now = time.perf_counter()
            clock = now - self.t0 - self.eval_seconds  # training seconds so far
            model = trainer.accelerator.unwrap_model(trainer.model)
            was_training = model.training
            try:
                results = evaluate(model)
            finally:
                model.train(was_training)
            self.eval_seconds += time.perf_counter() - now
            self.curve.append({"step": step, "seconds": clock,
                               **{k: results[k] for k in ("gold_win_rate", "gold_reward", "kl")}})

    return TimedEvaluation()


def our_config(args, output_dir: str):
    from async_rlhf.config.algorithms import AsyncOnlineDPOConfig
    from async_rlhf.config.cli import parse_args
    from async_rlhf.tasks.setup import ScriptArguments, task_defaults

    argv = ["--task", "builtin", "--output_dir", output_dir, "--max_steps", str(args.steps), "--seed", str(args.seed),
            "--gold_eval_steps", "0", "--eval_prompts", str(args.eval_prompts), "--disable_tqdm", "true",
            "--logging_steps", "10", *args.ours_flags]
    return parse_args((ScriptArguments, AsyncOnlineDPOConfig), argv, task_defaults("online_dpo"))


def run_ours(args, script, config) -> dict:
    from async_rlhf.tasks.setup import setup_task
    from async_rlhf.trainers.online_dpo import AsyncOnlineDPOTrainer

    task = setup_task(script, config)
    t0 = time.perf_counter()
    trainer = AsyncOnlineDPOTrainer(model=task.model, reward_funcs=task.reward, args=config,
                                    train_dataset=task.train_dataset)
    build_seconds = time.perf_counter() - t0
    clock = timed_evaluation(trainer, task.evaluate, args.eval_every, args.steps, t0)
    trainer.add_callback(clock)
    trainer.train()
    s = trainer.run_summary
    return {"curve": clock.curve, "train_seconds": time.perf_counter() - clock.t0 - clock.eval_seconds,
            "eval_seconds": clock.eval_seconds, "build_seconds": build_seconds, "first_step": clock.first_step,
            "learner_threads": config.cpu_learner_threads(),
            "generator_threads": config.generator_threads, "num_generations": config.num_generations,
            "generator_start_seconds": s.get("generator_start_seconds"), "learner_wait_seconds": s.get("wait_seconds"),
            "generator_backend": config.generator_backend, "startup": s.get("startup", {}),
            "summary": {k: v for k, v in s.items() if isinstance(v, (int, float))}}


def prompts_in_our_order(train_dataset, tokenizer, config, steps: int):
    """The prompts our run trains, step by step, as one dataset TRL reads in order: `PromptStream` over the prompts
    that fit (as our trainer keeps them: at most max_length - max_new_tokens tokens), `steps` steps of
    `config.prompts_per_step`; only the `prompt` column."""
    from async_rlhf.data.prompts import tokenize_prompts
    from async_rlhf.pipeline.prompt_stream import PromptStream

    _, kept_rows = tokenize_prompts(train_dataset, tokenizer, config.max_length - config.max_new_tokens)
    stream = PromptStream(len(kept_rows), config.prompts_per_step, config.seed)
    order = [kept_rows[i] for step in range(steps) for i in stream.prompts_for_step(step)]
    return train_dataset.select(order).select_columns(["prompt"])


def run_trl(args, script, config) -> dict:
    import torch
    from transformers import AutoTokenizer
    from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

    from async_rlhf.tasks.setup import setup_task

    threads = args.trl_threads or os.cpu_count() or 1  # synchronous: every stage may use every core
    torch.set_num_threads(threads)
    task = setup_task(script, config)
    tokenizer = AutoTokenizer.from_pretrained(task.model)
    dataset = prompts_in_our_order(task.train_dataset, tokenizer, config, args.steps)
    c = config
    trl_args = OnlineDPOConfig(
        output_dir=c.output_dir, max_steps=args.steps, per_device_train_batch_size=c.per_device_train_batch_size,
        gradient_accumulation_steps=c.gradient_accumulation_steps, learning_rate=c.learning_rate,
        lr_scheduler_type=c.lr_scheduler_type, warmup_steps=c.warmup_steps, weight_decay=c.weight_decay,
        adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2, adam_epsilon=c.adam_epsilon, max_grad_norm=c.max_grad_norm,
        optim=c.optim, beta=[c.beta] if not isinstance(c.beta, list) else c.beta, loss_type=c.loss_type,
        max_new_tokens=c.max_new_tokens, max_length=c.max_length, temperature=c.temperature, top_p=c.top_p,
        top_k=c.top_k or None, missing_eos_penalty=c.missing_eos_penalty, disable_dropout=c.disable_dropout,
        seed=c.seed, logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True,
        train_sampling_strategy="sequential", use_cpu=args.device == "cpu", bf16=args.device == "cuda")
    t0 = time.perf_counter()
    trainer = OnlineDPOTrainer(model=task.model, reward_funcs=task.reward, args=trl_args, train_dataset=dataset,
                               processing_class=tokenizer)
    build_seconds = time.perf_counter() - t0
    clock = timed_evaluation(trainer, task.evaluate, args.eval_every, args.steps, t0)
    trainer.add_callback(clock)
    trainer.train()
    return {"curve": clock.curve, "train_seconds": time.perf_counter() - clock.t0 - clock.eval_seconds,
            "eval_seconds": clock.eval_seconds, "build_seconds": build_seconds, "learner_threads": threads,
            "num_generations": 2, "first_step": clock.first_step}


def child(args) -> None:
    if args.run == "ours" and not args.cold:  # as the recipes do: generators' imports beside the learner's
        from async_rlhf.generation.pool.prewarm import prewarm_generators

        prewarm_generators()
    os.environ.setdefault("WANDB_MODE", "disabled")
    output_dir = tempfile.mkdtemp(prefix=f"vs_trl-{args.run}-s{args.seed}-")
    script, config = our_config(args, output_dir)
    result = run_trl(args, script, config) if args.run == "trl" else run_ours(args, script, config)
    result.update({"trainer": args.run, "seed": args.seed, "steps": args.steps})
    with open(args.result, "w") as f:
        json.dump(result, f)


# ---- parent: run both, compare ------------------------------------------------------------------------------------
def seconds_to(curve: list[dict], threshold: float, start_win_rate: float, key: str = "gold_win_rate") -> float | None:
    """Seconds at which the curve of `key` (the win-rate) first reaches `threshold`, linearly interpolated from
    `start_win_rate` at 0 s; None if it never does."""
    if start_win_rate >= threshold:
        return 0.0
    prev_s, prev_w = 0.0, start_win_rate
    for point in curve:
        s, w = point["seconds"], point[key]
        if w >= threshold:
            return s if w == prev_w else prev_s + (s - prev_s) * (threshold - prev_w) / (w - prev_w)
        prev_s, prev_w = s, w
    return None


def mean_curve(runs: list[dict], keys: tuple[str, ...] = ("gold_win_rate", "kl")) -> list[dict]:
    """The runs' curves averaged at the steps all of them evaluated: step, seconds and `keys`."""
    steps = sorted(set.intersection(*[{p["step"] for p in r["curve"]} for r in runs]))
    out = []
    for step in steps:
        points = [next(p for p in r["curve"] if p["step"] == step) for r in runs]
        out.append({k: sum(p[k] for p in points) / len(points) for k in ("step", "seconds", *keys)})
    return out


def run_child(run: dict, seed: int, args, result_dir: str) -> dict:
    """Runs one training run (`run`: {"name", "trainer", "flags"}) as a child process; returns its result."""
    stem = os.path.join(result_dir, f"{run['name'].replace(' ', '_').replace('-', '')}-seed{seed}")
    cmd = [sys.executable, os.path.abspath(__file__), "--run", run["trainer"], "--seed", str(seed), "--steps",
           str(args.steps), "--eval_every", str(args.eval_every), "--eval_prompts", str(args.eval_prompts),
           "--trl_threads", str(args.trl_threads), "--device", args.device, "--result", stem + ".json",
           *(["--cold"] if run.get("cold") else []), "--ours", *run["flags"]]
    print(f"[vs_trl] {run['name']} seed {seed} (log: {stem}.log)", flush=True)
    t0 = time.perf_counter()
    with open(stem + ".log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, timeout=args.run_timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{run['name']} seed {seed} failed (exit {proc.returncode}); see {stem}.log")
    with open(stem + ".json") as f:
        result = json.load(f)
    result.update({"name": run["name"], "process_wall_seconds": wall})
    return result


def report(results: list[dict], runs: list[dict], args, start_win_rate: float) -> dict:
    names = [r["name"] for r in runs]
    by = {n: [r for r in results if r["name"] == n] for n in names}
    curves = {n: mean_curve(by[n]) for n in names}
    gpu = f", {args.gpu_name}" if args.device == "cuda" else ""
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores{gpu}, load average before "
          f"{args.load_before}; {args.steps} steps, seeds {args.seeds}, gold evaluation on {args.eval_prompts} "
          f"prompts every {args.eval_every} steps (SFT start: {start_win_rate:.3f}); clock: training seconds from "
          f"building the trainer, evaluations excluded")
    for n in names:
        r = by[n][0]
        threads = (f"learner {r['learner_threads']} thread(s), generator {r['generator_threads']}"
                   if r["trainer"] == "ours" else f"{r['learner_threads']} threads")
        print(f"  {n}: {r['num_generations']} samples/prompt, {threads}")
    width = max(len(n) for n in names)
    steps = [int(p["step"]) for p in curves[names[0]]]
    print("\ngold win-rate (mean of seeds) at step " + " / ".join(str(s) for s in steps) + "; clock seconds there")
    for n in names:
        print(f"  {n:<{width}} " + " / ".join(f"{p['gold_win_rate']:.3f}" for p in curves[n])
              + "   s: " + " / ".join(f"{p['seconds']:.0f}" for p in curves[n]))
        for r in by[n]:
            print(f"  {'':<{width}}   seed {r['seed']}: " + " / ".join(f"{p['gold_win_rate']:.3f}" for p in r["curve"]))
    equal = min(max(p["gold_win_rate"] for p in curves[n]) for n in names)
    summary = {"curves": curves, "thresholds": []}
    for label, thr in (("--threshold", args.threshold), ("highest win-rate every run's mean curve reaches", equal)):
        times = {n: seconds_to(curves[n], thr, start_win_rate) for n in names}
        print(f"\nseconds to gold win-rate {thr:.3f} ({label}), mean curve [per seed]; ratio TRL / run")
        for n in names:
            per_seed = [seconds_to(r["curve"], thr, start_win_rate) for r in by[n]]
            ratio = times["trl"] / times[n] if times.get("trl") and times[n] else None  # None: a run never got there
            print(f"  {n:<{width}} {_fmt(times[n]):>7} [{', '.join(_fmt(x) for x in per_seed)}]"
                  + (f"  {ratio:.2f}x" if ratio and n != "trl" else ""))
        summary["thresholds"].append({"win_rate": thr, "label": label, "seconds": times})
    print("\nper run: clock s | building the trainer s | evaluation s | process wall s | first optimizer step s after "
          "process start | (ours) generator start s, generating s, learner training s, learner waiting s | backend, "
          "start-up timeline")
    for r in results:
        extra = ""
        if r["trainer"] == "ours":
            s = r["summary"]
            extra = (f" | {s['generator_start_seconds']:.1f}, {s['generate_seconds']:.0f}, {s['train_seconds']:.0f}, "
                     f"{s['wait_seconds']:.1f} | {r.get('generator_backend')}, "
                     + ", ".join(f"{k} {v:.1f}" for k, v in r.get("startup", {}).items()))
        print(f"  {r['name']:<{width}} seed {r['seed']}: {r['train_seconds']:.0f} | {r['build_seconds']:.1f} | "
              f"{r['eval_seconds']:.0f} | {r['process_wall_seconds']:.0f} | {_fmt(r.get('first_step'))}{extra}")
    for n in names:
        print(f"  {n:<{width}} mean: clock {_mean(r['train_seconds'] for r in by[n]):.0f} s, process wall "
              f"{_mean(r['process_wall_seconds'] for r in by[n]):.0f} s, first optimizer step "
              f"{_mean(r['first_step'] for r in by[n] if r.get('first_step') is not None):.1f} s after process start")
    return summary


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.1f}"


def _mean(xs) -> float:
    xs = list(xs)
    return sum(xs) / len(xs)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours_flags = argv[argv.index("--ours") + 1:] if "--ours" in argv else []
    argv = argv[:argv.index("--ours")] if "--ours" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval_every", type=int, default=20)
    p.add_argument("--eval_prompts", type=int, default=512)
    p.add_argument("--threshold", type=float, default=0.58, help="gold win-rate the runs are timed to")
    p.add_argument("--quick", action="store_true", help="one seed, 40 steps")
    p.add_argument("--variants", nargs="+", default=[""], metavar="FLAGS",
                   help="our runs, each one quoted string of recipe flags ('' is the default recipe); e.g. "
                        "--variants '' '--generator_backend transformers'")
    p.add_argument("--no_trl", action="store_true", help="only our runs")
    p.add_argument("--cold", action="store_true",
                   help="also run ours (the first variant) without the fork server's head start (generation/pool/"
                        "prewarm.py), as a trainer built in a script starts: what the prewarm is worth")
    p.add_argument("--trl_threads", type=int, default=0,
                   help="torch threads of TRL's run (0: every core, the fair peer on an idle machine; on a machine "
                        "loaded by other work, 2 OpenMP threads on 2 busy cores stall each other, so use 1 there)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="cuda: both trainers on the first GPU in bf16 (ours: learner and generator colocated there)")
    p.add_argument("--output_dir", default="outputs/vs_trl", help="results.json and each run's log")
    p.add_argument("--run_timeout", type=float, default=3600.0, help="seconds one run may take before it is killed")
    p.add_argument("--run", choices=TRAINERS, help=argparse.SUPPRESS)  # child mode
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.ours_flags = ours_flags
    if args.device == "cuda":  # before the user's flags, which may override them
        args.ours_flags = ["--bf16", "true", "--generator_devices", "cuda:0", "--colocate", "true",
                           "--generator_backend", "transformers", *ours_flags]
    if args.steps < 1 or args.eval_every < 1 or args.eval_prompts < 1 or args.trl_threads < 0:
        raise SystemExit(f"--steps, --eval_every, --eval_prompts must be >= 1 and --trl_threads >= 0, got "
                         f"{args.steps}, {args.eval_every}, {args.eval_prompts}, {args.trl_threads}")
    if args.run:
        return child(args)
    if args.quick:
        args.seeds, args.steps = args.seeds[:1], 40
    if not 0 < args.threshold < 1:
        raise SystemExit(f"--threshold must be in (0, 1), got {args.threshold}")
    runs = [] if args.no_trl else [{"name": "trl", "trainer": "trl", "flags": []}]
    for v in args.variants:
        flags = v.split() + ours_flags
        runs.append({"name": "ours " + " ".join(flags) if flags else "ours", "trainer": "ours", "flags": flags})
    if args.cold:
        runs.append({**runs[-len(args.variants)], "name": runs[-len(args.variants)]["name"] + " (cold)", "cold": True})
    if len({r["name"] for r in runs}) != len(runs):
        raise SystemExit(f"--variants: the same flags twice ({args.variants})")
    from async_rlhf.tasks.build_builtin import prepare_builtin

    with open(prepare_builtin(seed=0)["manifest"]) as f:
        start_win_rate = json.load(f)["sft_gold_win_rate"]
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA GPU")
        args.gpu_name = torch.cuda.get_device_name(0)
    args.load_before = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "?"
    os.makedirs(args.output_dir, exist_ok=True)
    results = []
    for i, seed in enumerate(args.seeds):  # alternate the order, so a drift in the machine's load hits every run
        for run in (runs if i % 2 == 0 else runs[::-1]):
            results.append(run_child(run, seed, args, args.output_dir))
    summary = report(results, runs, args, start_win_rate)  # without TRL, no ratios
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"settings": {k: v for k, v in vars(args).items() if k not in ("run", "seed", "result")},
                   "runs": results, **summary}, f, indent=1)


if __name__ == "__main__":
    main()
