"""Every optional mechanism against the default run, and TRL 1.16's GRPOTrainer with transformers' continuous
batching against ours, on the long-tail task with a policy trained on the device: the GPU kit's `mechanisms` and
`vs_trl_cb` parts (`benchmarks/gpu_kit.py`), which a CPU can run at tiny sizes.

    python benchmarks/mechanisms.py mechanisms --output_dir outputs/mechanisms --device cpu --tiny
    python benchmarks/mechanisms.py vs_trl --output_dir outputs/mechanisms --device cpu --tiny --seeds 0
    python benchmarks/mechanisms.py mechanisms --output_dir outputs/mechanisms --device cuda --budget 270

The workload. GRPO on the long-tail task's prompts (`data/longtail_task.py`: summaries of 3 to 194 tokens, heavy
tailed, their length set by the post) with its gold reward as the reward (`longtail_task.gold_reward`: no proxy
reward model, whose build is most of the task's 10-15 minute preparation) and `launch/configs/grpo_longtail.yaml`'s
settings (32 prompts x 2 completions a step, lr 5e-5, beta 0.05, up to 256 new tokens, temperature 1, max_staleness
1), except `loss_type` 'bnpo' for 'dapo' (train-while-generating refuses dapo, whose denominator is the whole
step's tokens; with one micro-batch on one process the two are the same sum over the same tokens). GRPO, not online
DPO: TRL 1.16's OnlineDPOTrainer has no continuous batching (`use_transformers_continuous_batching` is a field of
its GRPOConfig and RLOOConfig only), and (b) asks for TRL's continuous batching at the same settings.

The policy (`--run policy`, once per output folder, reused while its sizes are the same): a Llama of `--hidden_size`
x `--layers` (default 1024 x 6, 16 heads: about 101M parameters) trained from scratch on the task's demonstrations
for `--sft_steps` steps (`tasks/build_builtin.train_sft`, bf16 autocast on cuda), with the task's tokenizer. A random
policy would not do: it rarely samples EOS, so every completion would run to the cap and there would be no tail.
Its gold metrics before any RL step are the curves' start.

Runs, each a child process (cold: its own imports and start-up), `--steps` optimizer steps, the policy's gold
metrics (`gold_reward`, mean gold reward of greedy completions on `--eval_prompts` held-out prompts, and
`gold_win_rate` against the task's references) every `--eval_every` steps and at the end, off the clock (as
`benchmarks/vs_trl.py`: its `timed_evaluation`; the clock runs from before the trainer is built to the end of
`train()`). Ours runs transformers' continuous-batching generator backend (`continuous_batching`,
`experimental/continuous_batching/`), on cuda one generator colocated with the learner on cuda:0 (weights as CUDA
IPC handles), bf16.

`mechanisms`: the default run, then one run per mechanism in `MECHANISMS` that the continuous-batching backend can
take; one it cannot (the config refuses it, or it needs more generators than the default's one) is recorded as
skipped with the config's reason. Per mechanism, against the default (streaming is the default on this backend: its
row compares the default against static transformers batches): clock (seconds; ratio: the slower clock over the
faster is how much faster the mechanism's side is, > 1 pays), samples/s over the training loop (generator start
excluded; ratio), and the gold reward at the end (both values and the difference: it can be negative, so no ratio).

`vs_trl`: for each of `--seeds`, TRL's GRPOTrainer (`use_transformers_continuous_batching=True`, the same
ContinuousBatchingConfig as ours: on GPU both leave transformers' sizing with max_memory_percent 0.5, on CPU both
get our CPU cache sizes) and ours, on the same prompts in the same order (`vs_trl.prompts_in_our_order`; TRL reads
them unshuffled). Reported: clocks, the seconds each takes to the highest gold reward every trainer's mean curve
reaches (interpolated as `vs_trl.seconds_to`), on the clock and counted from process start, and (c) each run's
start-up timeline in seconds since its process started: ours from its `run_summary.json` (`trainers/startup.py`:
trainer entered, generators spawned, models loaded, trainer built, train called, generators ready, first step), TRL's
from callbacks (trainer entered, trainer built, train called, first step begun, first step; its generation runs
inside each step, its continuous-batching manager built by every `generate_batch` call, so there is no separate
"generator ready"). Our default run of `mechanisms` is seed 0's run here when its workload is the same (reused, not
run again). Differences that remain: TRL's GRPO is synchronous (on-policy), ours trains one step behind at most
(max_staleness 1, off-policy correction on); TRL passes no `truncated` flags to the reward (a completion cut at the
cap is scored as text), ours does.

Each invocation stops starting runs when fewer than `MIN_RUN_SECONDS` of `--budget` are left (each run's own limit is
`--run_timeout`, or what is left); what it did not run is recorded as such. `<output_dir>/mechanisms.json` and
`vs_trl.json` are rewritten after every run; each run's result and log are in `<output_dir>/runs/`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _path in (ROOT, HERE):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# the GPU workload (defaults) and the CPU check's (`--tiny`): policy size, SFT steps, the run's sizes
SIZES = dict(hidden_size=1024, layers=6, heads=16, sft_steps=300, sft_lr=5e-4, prompts=32, steps=16, eval_every=8,
             eval_prompts=64, max_new_tokens=256)
TINY = dict(hidden_size=64, layers=2, heads=2, sft_steps=20, sft_lr=2e-3, prompts=4, steps=2, eval_every=2,
            eval_prompts=8, max_new_tokens=24)
MIN_RUN_SECONDS = 30.0  # no run starts with less of the budget left
METRIC = "gold_reward"  # the gold metric runs are timed to (the win-rate against references is also recorded)

# (mechanism, its option, the run's flags, which side of the comparison that run is: "on" (the mechanism's run
# against the default) or "off" (the default is the mechanism's side), or None with the reason it is not run).
# "{dev}" is the generator device of the default run. Partial rollouts, tail migration and speculative rollouts are
# refused by the config on transformers generators today; they stay listed so that the record says so.
MECHANISMS = [
    ("streaming", "continuous_batching (generation_mode stream)",
     ["--continuous_batching", "false", "--generator_backend", "transformers", "--generation_mode", "batch"], "off"),
    ("train-while-generating", "train_while_generating", ["--train_while_generating", "true"], "on"),
    ("fused reference", "reference_while_generating",
     ["--score_while_generating", "true", "--reference_while_generating", "true"], "on"),
    ("shared prefixes", "reference_shared_prefix (split_forwards)",
     ["--reference_shared_prefix", "true", "--split_forwards", "true"], "on"),
    ("in-flight weight loads", "weight_load in_flight", ["--weight_load", "in_flight"], "on"),
    ("autoscaling", "generator_autoscale",
     ["--generator_autoscale", "true", "--generator_autoscale_devices", "{dev}"], "on"),
    ("partial rollouts", "partial_rollouts", ["--partial_rollouts", "8", "--weight_load", "in_flight"], "on"),
    ("tail migration", "tail_migration",
     ["--tail_migration", "4", "--weight_load", "in_flight", "--generator_devices", "{dev}", "{dev}"], "on"),
    ("speculative rollouts", "speculative", ["--speculative", "ngram"], "on"),
    ("length-aware assignment", "generator_assignment tokens", None,
     "the default run has one generator: assignment spreads a batch over several (and 'tokens', the length-aware "
     "rule, is already the default)"),
    ("shared prefixes, reward", "reward_shared_prefix", None,
     "the reward is a function (the task's gold reward), not a reward model: nothing to forward"),
]


# ---- children: the policy, one training run ----------------------------------------------------------------------
def process_start() -> float:
    import psutil

    return psutil.Process().create_time()


def build_policy(args) -> None:
    """Train the run's policy on the task's demonstrations, save it with the tokenizer, evaluate it (the curves'
    start), and write `policy.json`."""
    t0 = time.perf_counter()
    from accelerate import Accelerator

    from async_rlhf.data import longtail_task
    from async_rlhf.data.tokenizer import build_tokenizer
    from async_rlhf.tasks.build_builtin import SFTSettings, train_sft

    path = os.path.join(args.output_dir, "policy")
    tokenizer = build_tokenizer(max(512, longtail_task.SFT_MAX_POSITIONS), vocabulary=longtail_task.VOCABULARY)
    settings = SFTSettings(seed=0, steps=args.sft_steps, batch_size=32, learning_rate=args.sft_lr,
                           hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads,
                           length_grouped=True)
    accelerator = Accelerator(cpu=args.device == "cpu", mixed_precision="bf16" if args.device == "cuda" else "no")
    t_sft = time.perf_counter()
    model = train_sft(settings, tokenizer, accelerator, task=longtail_task,
                      max_positions=longtail_task.SFT_MAX_POSITIONS)
    sft_seconds = time.perf_counter() - t_sft
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    model.eval()
    start = task_for(path, args)["evaluate"](model)
    with open(os.path.join(args.output_dir, "policy.json"), "w") as f:
        json.dump({"path": path, "sizes": policy_sizes(args), "device": args.device,
                   "parameters": sum(p.numel() for p in model.parameters()), "sft_seconds": sft_seconds,
                   "seconds": time.perf_counter() - t0, "seconds_since_process_start": time.time() - process_start(),
                   "start": {k: v for k, v in start.items() if k != "examples"}}, f, indent=1)


def policy_sizes(args) -> dict:
    return {k: getattr(args, k) for k in ("hidden_size", "layers", "heads", "sft_steps", "sft_lr", "eval_prompts",
                                          "max_new_tokens")}


def workload(args) -> dict:
    """What makes two runs' results comparable (a run of `mechanisms` is reused by `vs_trl` when it is the same)."""
    return {**policy_sizes(args), **{k: getattr(args, k) for k in ("prompts", "steps", "eval_every", "device")}}


def task_for(policy: str, args) -> dict:
    """The long-tail task's train prompts and an `evaluate(model)` of the gold metrics (greedy, `eval_prompts` held-out
    prompts, up to `max_new_tokens`; no KL: the reference would run on the CPU, seconds a call on a 100M policy)."""
    from transformers import AutoTokenizer

    from async_rlhf.data import longtail_task
    from async_rlhf.tasks.evaluation import evaluate_policy

    splits = longtail_task.make_splits(seed=0, sizes={"validation": 0, "test": max(1, args.eval_prompts)})
    tokenizer = AutoTokenizer.from_pretrained(policy)

    def evaluate(model) -> dict:
        return evaluate_policy(model, None, args.eval_prompts, dataset=splits["test"], tokenizer=tokenizer,
                               reward_fn=longtail_task.gold_reward, max_new_tokens=args.max_new_tokens)

    return {"train": splits["train"], "evaluate": evaluate, "reward": longtail_task.gold_reward}


def cb_config(policy: str, device: str) -> dict | None:
    """The ContinuousBatchingConfig arguments both trainers get: None on GPU (transformers sizes the cache, with
    max_memory_percent 0.5 in both), on CPU our backend's CPU sizes (`experimental/continuous_batching/backend.py`:
    left alone, transformers would size the cache from host RAM)."""
    if device != "cpu":
        return None
    from transformers import AutoConfig

    from async_rlhf.experimental.continuous_batching import backend as cb

    return {"page_size": cb.CPU_PAGE_SIZE, "max_batch_tokens": cb.CPU_MAX_BATCH_TOKENS,
            "num_blocks": cb.cpu_num_blocks(AutoConfig.from_pretrained(policy), dtype_bytes=4)}  # float32 on CPU


def our_argv(args, output_dir: str, flags: list[str], seed: int = 0) -> list[str]:
    """The recipe's flags of our run (`recipes/grpo.py --task longtail`), the mechanism's `flags` last (they win)."""
    device = ["--generator_devices", "cpu"] if args.device == "cpu" else [
        "--generator_devices", "cuda:0", "--colocate", "true", "--bf16", "true"]
    micro = ["--per_device_train_batch_size", str(2 * args.prompts // 4), "--gradient_accumulation_steps", "4"] if (
        "--train_while_generating" in flags) else ["--per_device_train_batch_size", str(2 * args.prompts)]
    cb = cb_config(args.policy, args.device) if args.policy else None
    dev = "cpu" if args.device == "cpu" else "cuda:0"
    return ["--task", "longtail", "--output_dir", output_dir, "--max_steps", str(args.steps), "--seed", str(seed),
            "--loss_type", "bnpo", "--num_generations", "2", "--max_new_tokens", str(args.max_new_tokens),
            "--continuous_batching", "true", "--disable_tqdm", "true", "--logging_steps", "10", *device, *micro,
            *(["--continuous_batching_config", json.dumps(cb)] if cb else []),
            *[f.replace("{dev}", dev) for f in flags]]


def our_config(args, output_dir: str, flags: list[str], seed: int = 0):
    from async_rlhf.config.algorithms import AsyncGRPOConfig
    from async_rlhf.config.cli import parse_args
    from async_rlhf.tasks.setup import ScriptArguments, task_defaults

    return parse_args((ScriptArguments, AsyncGRPOConfig), our_argv(args, output_dir, flags, seed),
                      task_defaults("grpo"))[1]


def refusal(args, flags: list[str]) -> str | None:
    """Why our config refuses this run (None: it takes it), checked before anything runs."""
    import tempfile

    from async_rlhf.errors import ConfigError

    try:
        with tempfile.TemporaryDirectory(prefix="mechanisms-check-") as out:
            our_config(args, out, flags)
    except (ConfigError, ValueError, SystemExit) as exc:  # SystemExit: the parser's own refusal of a flag
        return str(exc) or type(exc).__name__
    return None


def startup_marks():
    """A callback recording TRL's start-up milestones in seconds since process start (ours records its own)."""
    from transformers import TrainerCallback

    origin = process_start()

    class Marks(TrainerCallback):
        def __init__(self):
            self.marks: dict[str, float] = {}

        def mark(self, name: str) -> None:
            self.marks.setdefault(name, round(time.time() - origin, 3))

        def on_train_begin(self, args, state, control, **kwargs):
            self.mark("train_called")

        def on_step_begin(self, args, state, control, **kwargs):
            self.mark("first_step_begun")

        def on_step_end(self, args, state, control, **kwargs):
            self.mark("first_step")

    return Marks()


def child(args) -> None:
    if args.run == "policy":
        return build_policy(args)
    from vs_trl import prompts_in_our_order, timed_evaluation

    if args.run == "ours":  # as the recipes do: the generators' imports beside the learner's
        from async_rlhf.generation.pool.prewarm import prewarm_generators

        prewarm_generators()
    os.environ.setdefault("WANDB_MODE", "disabled")
    output_dir = os.path.join(args.output_dir, "runs", f"{args.name}-seed{args.seed}-output")
    config = our_config(args, output_dir, args.flags, args.seed)
    task = task_for(args.policy, args)
    entered = round(time.time() - process_start(), 3)
    t0 = time.perf_counter()
    if args.run == "ours":
        from async_rlhf.trainers.grpo import AsyncGRPOTrainer

        trainer = AsyncGRPOTrainer(model=args.policy, reward_funcs=task["reward"], args=config,
                                   train_dataset=task["train"])
    else:
        import torch
        from transformers import AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer

        if args.device == "cpu":
            torch.set_num_threads(os.cpu_count() or 1)  # synchronous: every stage may use every core
        tokenizer = AutoTokenizer.from_pretrained(args.policy)
        c = config
        trl_args = GRPOConfig(
            output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=c.per_device_train_batch_size,
            gradient_accumulation_steps=c.gradient_accumulation_steps, num_generations=c.num_generations,
            learning_rate=c.learning_rate, lr_scheduler_type=c.lr_scheduler_type, warmup_steps=c.warmup_steps,
            weight_decay=c.weight_decay, adam_beta1=c.adam_beta1, adam_beta2=c.adam_beta2,
            adam_epsilon=c.adam_epsilon, max_grad_norm=c.max_grad_norm, optim=c.optim, beta=c.beta,
            loss_type=c.loss_type, scale_rewards=c.scale_rewards, epsilon=c.epsilon, epsilon_high=c.epsilon_high,
            max_completion_length=c.max_new_tokens, temperature=c.temperature, top_p=c.top_p, top_k=c.top_k or 0,
            seed=c.seed, logging_steps=10, save_strategy="no", report_to="none", disable_tqdm=True,
            shuffle_dataset=False, use_cpu=args.device == "cpu", bf16=args.device == "cuda",
            use_transformers_continuous_batching=True,
            transformers_continuous_batching_config=cb_config(args.policy, args.device))
        dataset = prompts_in_our_order(task["train"], tokenizer, config, args.steps)
        marks = startup_marks()
        marks.marks["trainer_entered"] = entered
        trainer = GRPOTrainer(model=args.policy, reward_funcs=task["reward"], args=trl_args, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[marks])
        marks.mark("trainer_built")
    build_seconds = time.perf_counter() - t0
    clock = timed_evaluation(trainer, task["evaluate"], args.eval_every, args.steps, t0)
    trainer.add_callback(clock)
    trainer.train()
    clock_seconds = time.perf_counter() - t0 - clock.eval_seconds
    samples = args.steps * args.prompts * 2
    result = {"trainer": args.run, "name": args.name, "seed": args.seed, "flags": args.flags,
              "workload": workload(args), "curve": clock.curve, "clock_seconds": clock_seconds,
              "clock_origin": entered, "eval_seconds": clock.eval_seconds, "build_seconds": build_seconds,
              "first_step": clock.first_step, "samples": samples}
    if args.run == "ours":
        s = trainer.run_summary
        counts = {int(k): v for k, v in s["completion_length_counts"].items()}
        result.update(startup=s.get("startup", {}), loop_seconds=s["loop_seconds"],
                      samples_per_s=s["samples"] / s["loop_seconds"] if s["loop_seconds"] else None,
                      lengths=length_stats(counts), generator_backend=config.generator_backend,
                      generation_mode=s["generation_mode"], continuous_batching=config.continuous_batching,
                      summary={k: v for k, v in s.items() if isinstance(v, (int, float))})
    else:
        result.update(startup=dict(sorted(marks.marks.items(), key=lambda kv: kv[1])),
                      samples_per_s=samples / clock_seconds)
    with open(args.result, "w") as f:
        json.dump(result, f)


def length_stats(counts: dict[int, int]) -> dict:
    """Mean, 90th percentile and longest of the completion lengths a run sampled (the tail it had to wait for)."""
    total = sum(counts.values())
    if not total:
        return {}
    seen, p90 = 0, None
    for length in sorted(counts):
        seen += counts[length]
        if p90 is None and seen >= 0.9 * total:
            p90 = length
    return {"mean": sum(k * v for k, v in counts.items()) / total, "p90": p90, "max": max(counts)}


# ---- the parent: runs as children, the comparisons ----------------------------------------------------------------
class Runner:
    """Starts the children within the invocation's budget and keeps each one's result file."""

    def __init__(self, args):
        self.args = args
        self.deadline = time.monotonic() + args.budget
        self.runs_dir = os.path.join(args.output_dir, "runs")
        os.makedirs(self.runs_dir, exist_ok=True)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def child(self, run: str, name: str, seed: int = 0, flags: list[str] = (), log: str | None = None) -> dict:
        """One child process; returns its result, or {"status": why not, "log": ...}."""
        stem = os.path.join(self.runs_dir, f"{name}-seed{seed}")
        log = log or stem + ".log"
        if self.left() < MIN_RUN_SECONDS:
            return {"status": "not run", "error": f"out of time ({self.left():.0f} s of the budget left)"}
        a = self.args
        cmd = [sys.executable, os.path.abspath(__file__), "--run", run, "--name", name, "--seed", str(seed),
               "--device", a.device, "--output_dir", a.output_dir, "--result", stem + ".json",
               "--policy", a.policy or ""]
        cmd += [f"--{k}={getattr(a, k)}" for k in SIZES] + ["--flags", *flags]
        timeout = min(a.run_timeout, self.left())
        print(f"[mechanisms] {name} seed {seed} (log: {log}; {timeout:.0f} s at most)", flush=True)
        t0 = time.perf_counter()
        with open(log, "a") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                from gpu_kit import _kill_tree  # the run and its generators

                _kill_tree(proc.pid)
                proc.wait()
                return {"status": "timeout", "error": f"over its {timeout:.0f} s", "log": log}
        if proc.returncode != 0:
            tail = open(log, errors="replace").read()[-1500:]
            return {"status": "failed", "error": f"exit {proc.returncode}: {tail}", "log": log}
        if run == "policy":
            return {"status": "ok"}
        with open(stem + ".json") as f:
            result = json.load(f)
        result.update(status="ok", process_wall_seconds=time.perf_counter() - t0, log=log)
        return result

    def policy(self) -> dict:
        """The policy of these sizes, built once per output folder."""
        a = self.args
        path = os.path.join(a.output_dir, "policy.json")
        if os.path.isfile(path):
            with open(path) as f:
                built = json.load(f)
            if built["sizes"] == policy_sizes(a) and built["device"] == a.device:
                a.policy = built["path"]
                return built
        result = self.child("policy", "policy", log=os.path.join(self.runs_dir, "policy.log"))
        if result["status"] != "ok":
            raise RuntimeError(f"building the policy: {result['status']}: {result.get('error', '')}")
        with open(path) as f:
            built = json.load(f)
        a.policy = built["path"]
        return built

    def ours(self, name: str, flags: list[str], seed: int = 0) -> dict:
        """Our run, or the finished one of the same name, seed and workload (`mechanisms`' default for `vs_trl`)."""
        path = os.path.join(self.runs_dir, f"{name}-seed{seed}.json")
        if os.path.isfile(path):
            with open(path) as f:
                done = json.load(f)
            if done.get("workload") == workload(self.args) and done.get("flags") == list(flags):
                return {**done, "status": "ok", "reused": True}
        return self.child("ours", name, seed, flags)


def _write(args, name: str, data: dict) -> None:
    with open(os.path.join(args.output_dir, name), "w") as f:
        json.dump(data, f, indent=1)


def _final(run: dict) -> dict:
    return run["curve"][-1] if run.get("curve") else {}


def compare(on: dict, off: dict) -> dict:
    """The mechanism's side (`on`) against the other: clock and samples/s as speed ratios (> 1: `on` is faster),
    the final gold reward as both values and their difference."""
    out = {}
    if on.get("clock_seconds") and off.get("clock_seconds"):
        out["clock_ratio"] = off["clock_seconds"] / on["clock_seconds"]
    if on.get("samples_per_s") and off.get("samples_per_s"):
        out["samples_per_s_ratio"] = on["samples_per_s"] / off["samples_per_s"]
    g_on, g_off = _final(on).get(METRIC), _final(off).get(METRIC)
    if g_on is not None and g_off is not None:
        out.update(gold_on=g_on, gold_off=g_off, gold_difference=g_on - g_off)
    return out


def brief(run: dict) -> dict:
    """What a report keeps of a run."""
    keep = ("status", "error", "name", "seed", "clock_seconds", "loop_seconds", "samples_per_s", "lengths",
            "first_step", "clock_origin", "startup", "generation_mode", "reused")
    out = {k: run[k] for k in keep if k in run}
    if run.get("status") == "ok":
        out["final"] = {k: v for k, v in _final(run).items() if k in (METRIC, "gold_win_rate", "step")}
    return out


def mechanisms(args) -> dict:
    runner = Runner(args)
    results: dict = {"workload": None, "policy": None, "default": None, "mechanisms": []}
    results["policy"] = runner.policy()
    results["workload"] = workload(args)
    _write(args, "mechanisms.json", results)
    rows = []
    for name, option, flags, side in MECHANISMS:  # the config's refusals first: they cost nothing
        reason = side if flags is None else refusal(args, flags)
        rows.append({"mechanism": name, "option": option, "flags": flags, "side": side if flags else None,
                     **({"status": "skipped", "reason": reason} if reason else {"status": "pending"})})
    results["mechanisms"] = rows
    default = runner.ours("default", [])
    results["default"] = brief(default)
    _write(args, "mechanisms.json", results)
    for row in rows:
        if row["status"] != "pending":
            continue
        if default["status"] != "ok":  # nothing to compare with: the budget is better left to the next part
            row.update(status="not run", run={"error": f"the default run did not finish ({default['status']})"})
            continue
        run = runner.ours(re.sub(r"\W+", "_", row["mechanism"]), row["flags"])
        row.update(status=run["status"], run=brief(run))
        if run["status"] == "ok":
            on, off = (run, default) if row["side"] == "on" else (default, run)
            row.update(compare(on, off))
        _write(args, "mechanisms.json", results)
    print(mechanism_table(results), flush=True)
    return results


def mechanism_table(results: dict) -> str:
    lines = ["| mechanism | status | clock ratio | samples/s ratio | gold reward, mechanism / without |",
             "| --- | --- | --- | --- | --- |"]
    for r in results["mechanisms"]:
        if r["status"] != "ok":
            lines.append(f"| {r['mechanism']} | {r['status']}: {r.get('reason') or r.get('run', {}).get('error', '')}"
                         [:300] + " | - | - | - |")
            continue
        lines.append(f"| {r['mechanism']} | ok | {_num(r.get('clock_ratio'))}x | {_num(r.get('samples_per_s_ratio'))}x"
                     f" | {_num(r.get('gold_on'), 3)} / {_num(r.get('gold_off'), 3)} |")
    return "\n".join(lines)


def vs_trl(args) -> dict:
    from vs_trl import mean_curve, seconds_to

    runner = Runner(args)
    results: dict = {"policy": runner.policy(), "workload": workload(args), "runs": []}
    start = results["policy"]["start"][METRIC]
    for i, seed in enumerate(args.seeds):  # alternate the order, as vs_trl.py does
        for trainer in (("trl", "ours") if i % 2 == 0 else ("ours", "trl")):
            run = runner.ours("default", [], seed) if trainer == "ours" else runner.child("trl", "trl", seed)
            results["runs"].append({"trainer": trainer, "seed": seed, **brief(run),
                                    **({"curve": run["curve"]} if run.get("status") == "ok" else {})})
            _write(args, "vs_trl.json", results)
    ok = {t: [r for r in results["runs"] if r["trainer"] == t and r["status"] == "ok"] for t in ("trl", "ours")}
    seeds = sorted({r["seed"] for r in ok["trl"]} & {r["seed"] for r in ok["ours"]})
    if seeds:
        both = {t: [r for r in ok[t] if r["seed"] in seeds] for t in ok}
        curves = {t: mean_curve(both[t], keys=(METRIC, "gold_win_rate")) for t in both}
        threshold = min(max(p[METRIC] for p in curves[t]) for t in curves)
        clock = {t: sum(r["clock_seconds"] for r in both[t]) / len(seeds) for t in both}
        origin = {t: sum(r["clock_origin"] for r in both[t]) / len(seeds) for t in both}
        to = {t: seconds_to(curves[t], threshold, start, key=METRIC) for t in both}
        results.update(
            seeds=seeds, start=start, threshold=threshold, clock=clock,
            clock_ratio=clock["trl"] / clock["ours"] if clock["ours"] else None,
            seconds_to_threshold=to,
            seconds_to_threshold_from_process_start={t: to[t] + origin[t] if to[t] is not None else None for t in to},
            per_seed={t: [seconds_to(r["curve"], threshold, start, key=METRIC) for r in both[t]] for t in both},
            startup={t: _mean_marks([r.get("startup", {}) for r in both[t]]) for t in both})
        if to["trl"] is not None and to["ours"]:
            results["time_to_threshold_ratio"] = to["trl"] / to["ours"]
    _write(args, "vs_trl.json", results)
    print(json.dumps({k: v for k, v in results.items() if k not in ("runs", "policy")}, indent=1), flush=True)
    return results


def _mean_marks(marks: list[dict]) -> dict:
    """Each milestone's mean over the runs that reached it, in the order reached."""
    names = {k for m in marks for k in m}
    mean = {k: sum(m[k] for m in marks if k in m) / sum(k in m for m in marks) for k in names}
    return dict(sorted(mean.items(), key=lambda kv: kv[1]))


def _num(x, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def main(argv: list[str] | None = None) -> dict | None:
    argv = sys.argv[1:] if argv is None else argv
    flags = argv[argv.index("--flags") + 1:] if "--flags" in argv else []
    argv = argv[:argv.index("--flags")] if "--flags" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="?", choices=("mechanisms", "vs_trl"),
                   help="mechanisms: each one against the default run; vs_trl: TRL's GRPO with continuous batching "
                        "against ours, --seeds")
    p.add_argument("--output_dir", default="outputs/mechanisms", help="the policy, runs/, mechanisms.json, vs_trl.json")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="CPU-check sizes (TINY): a toy policy, 2 steps")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="vs_trl: seeds (as time allows)")
    p.add_argument("--budget", type=float, default=1800.0, help="seconds for every run of this invocation")
    p.add_argument("--run_timeout", type=float, default=600.0, help="seconds one run may take")
    for k, v in SIZES.items():
        p.add_argument(f"--{k}", type=type(v), default=None, help=f"default {v} ({TINY[k]} with --tiny)")
    p.add_argument("--run", choices=("policy", "ours", "trl"), help=argparse.SUPPRESS)  # child mode
    p.add_argument("--name", default="", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--policy", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.flags = flags
    for k, v in (TINY if args.tiny else SIZES).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.prompts % 4 or args.steps < 1 or args.eval_every < 1 or args.eval_prompts < 1 or args.budget <= 0:
        p.error(f"--prompts must be a multiple of 4 (train-while-generating splits a step in 4 micro-batches of "
                f"whole groups), "
                f"--steps, --eval_every, --eval_prompts and --budget positive; got {args.prompts}, {args.steps}, "
                f"{args.eval_every}, {args.eval_prompts}, {args.budget}")
    args.output_dir = os.path.abspath(args.output_dir)
    os.makedirs(args.output_dir, exist_ok=True)
    if args.run:
        return child(args)
    if args.what is None:
        p.error("say what to run: mechanisms or vs_trl")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: torch sees no CUDA GPU")
    return mechanisms(args) if args.what == "mechanisms" else vs_trl(args)


if __name__ == "__main__":
    main()
