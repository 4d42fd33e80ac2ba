"""Multi-turn GRPO with a slow tool: our asynchronous trainer (max_staleness 0, 1, 2) against TRL 1.16's GRPOTrainer
with the same `environment_factory`, on the guessing task (docs/guess_task.md), with a latency injected into every
tool call.

    python benchmarks/agentic.py --quick                       # latency 0.2 s, 1 seed, 8 steps: a smoke run
    python benchmarks/agentic.py --latencies 0 0.05 0.2 --seeds 0 --steps 12

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
"""

from __future__ import annotations

import argparse
import json
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

from async_rlhf.data.guess_task import GuessEnv  # noqa: E402

LATENCY_ENV = "AGENTIC_TOOL_LATENCY"


class LatencyGuessEnv(GuessEnv):
    """`GuessEnv` with `AGENTIC_TOOL_LATENCY` seconds of waiting in every call (read at each call, so the generator
    processes, which inherit the variable, wait as long)."""

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: the number guessed, from 0 to 15

        Returns:
            higher, lower or correct
        """
        time.sleep(float(os.environ.get(LATENCY_ENV, "0")))
        return super().guess(n)


# ---- a child: one training run --------------------------------------------------------------------------------------
def child(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentic import LatencyGuessEnv as Env  # by module name, so generator processes can unpickle the factory
    from async_rlhf.data import guess_task
    from async_rlhf.tasks.build_guess import prepare_guess
    from async_rlhf.tasks.guess_evaluation import evaluate_guess_policy

    paths = prepare_guess(seed=0)
    dataset = guess_task.make_split(args.prompts * args.steps * 2, args.seed, "train")
    fields = dict(output_dir=args.output_dir, per_device_train_batch_size=args.prompts * 8, num_generations=8,
                  max_completion_length=256, max_tool_calling_iterations=5, learning_rate=1e-4,
                  lr_scheduler_type="constant", beta=0.0, max_steps=args.steps, logging_steps=1, report_to="none",
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
    trainer.train()
    clock = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    model = trainer.accelerator.unwrap_model(trainer.model)
    policy = AutoModelForCausalLM.from_pretrained(paths["sft_model"])
    policy.load_state_dict({k: v.detach().cpu().float() for k, v in model.state_dict().items()})
    torch.manual_seed(0)
    held_out = evaluate_guess_policy(policy, AutoTokenizer.from_pretrained(paths["tokenizer"]), "guess",
                                     args.eval_episodes, seed=0)
    return {"trainer": args.trainer, "max_staleness": args.max_staleness if args.trainer == "ours" else None,
            "latency": float(os.environ.get(LATENCY_ENV, "0")), "seed": args.seed, "steps": args.steps,
            "episodes": args.steps * args.prompts * 8, "clock_seconds": clock,
            "episodes_per_s": args.steps * args.prompts * 8 / clock,
            "train_reward_first": logs[0]["reward"] if logs else None,
            "train_reward_last": logs[-1]["reward"] if logs else None,
            "tool_calls_per_episode": sum(h.get("tools/call_frequency", 0) for h in logs) / max(1, len(logs)),
            "held_out_success": held_out["success_rate"], "held_out_turns": held_out["turns_mean"]}


# ---- the parent ---------------------------------------------------------------------------------------------------
def run_child(trainer: str, latency: float, seed: int, staleness: int, args, out_dir: str) -> dict | None:
    name = f"{trainer}{'' if trainer == 'trl' else f'-s{staleness}'}-lat{latency:g}-seed{seed}"
    path = os.path.join(out_dir, name + ".json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--trainer", trainer, "--seed", str(seed),
           "--max_staleness", str(staleness), "--steps", str(args.steps), "--prompts", str(args.prompts),
           "--eval_episodes", str(args.eval_episodes), "--output_dir", os.path.join(out_dir, name), "--json", path]
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
    p.add_argument("--latencies", type=float, nargs="+", default=[0.0, 0.05, 0.2])
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2], help="ours: max_staleness values")
    p.add_argument("--trainers", nargs="+", default=["trl", "ours"], choices=["trl", "ours"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--prompts", type=int, default=4, help="prompts a step (x 8 episodes)")
    p.add_argument("--eval_episodes", type=int, default=128)
    p.add_argument("--run_timeout", type=float, default=1800.0)
    p.add_argument("--output_dir", default="outputs/agentic")
    p.add_argument("--quick", action="store_true", help="latency 0.2, seed 0, S=1, 8 steps, 64 held-out episodes")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trainer", default="ours", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--max_staleness", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        result = child(args)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        return result
    if args.quick:
        args.latencies, args.seeds, args.staleness, args.steps, args.eval_episodes = [0.2], [0], [1], 8, 64
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
    return report


if __name__ == "__main__":
    main()
