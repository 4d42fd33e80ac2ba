"""`python -m async_rlhf.plan`: the ranked plans for a model, a workload and a number of devices.

    python -m async_rlhf.plan --model_size 8B --gpus 8 --gpu_type H100
    python -m async_rlhf.plan --model_size 70B --gpus 128 --nodes 16 --gpu_type H100 --top 5
    python -m async_rlhf.plan --model_size 8B --gpus 8 --gpu_type H100 --deadline 10 --steps 1000
    python -m async_rlhf.plan --model ~/.cache/async_rlhf/builtin-v5/sft_model --gpus 2 --gpu_type cpu \
        --prompts_per_step 32 --prompt_length 64 --response_mean 6 --response_cv 0.8 --response_max 24

Every figure it prints is a prediction of the cost model and the simulator (docs/planning.md: what they count, and
how far they were off on measured runs).
"""

from __future__ import annotations

import argparse
import sys

from async_rlhf.plan import search as sr
from async_rlhf.plan.commands import (
    any_node_command,
    describe,
    launch_command,
    ray_any_node_command,
)
from async_rlhf.plan.cost_model import Workload
from async_rlhf.plan.hardware import get_profile, load_profile
from async_rlhf.plan.model_shapes import resolve_model


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m async_rlhf.plan", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Hugging Face config.json, or the model directory holding it")
    p.add_argument("--model_size", help="parameter count with the standard shape of that size, e.g. 8B, 70B")
    p.add_argument("--gpus", type=int, required=True, help="devices in all (learners + generators)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpu_type", default="H100", help="H100, H200, A100, L40S or cpu (analytical, or measured: cpu)")
    p.add_argument("--profile", help="a profile measured by benchmarks/device_profile.py (replaces what it measured)")
    p.add_argument("--prompts_per_step", type=int, default=64)
    p.add_argument("--n", type=int, default=2, help="samples per prompt (num_generations)")
    p.add_argument("--prompt_length", type=int, default=256, help="tokens")
    p.add_argument("--response_mean", type=float, default=256.0, help="tokens")
    p.add_argument("--response_cv", type=float, default=0.5, help="coefficient of variation of response lengths")
    p.add_argument("--response_max", type=int, default=1024, help="tokens (max_new_tokens)")
    p.add_argument("--reward_size", help="reward model parameters (default: the policy's)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps of the run (deadline and budget)")
    p.add_argument("--deadline", type=float, help="hours: the cheapest plan (GPU-hours) that finishes in time")
    p.add_argument("--budget", type=float, help="GPU-hours: the fastest plan that costs no more")
    p.add_argument("--any_node_generators", action="store_true",
                   help="let generators sit on any node (vLLM servers on GPUs, Ray actors on CPUs; weights over the "
                        "network to those off node 0)")
    p.add_argument("--head_address", default="<node 0 address>",
                   help="node 0's address in the printed any-node commands (127.0.0.1: every node on this machine)")
    p.add_argument("--learners", type=int, help="only plans with this many learner ranks")
    p.add_argument("--generators", type=int, help="only plans with this many generators")
    p.add_argument("--tp", type=int, help="only plans with this vLLM tensor parallel size")
    p.add_argument("--top", type=int, default=10)
    args = p.parse_args(argv)
    for name in ("gpus", "nodes", "steps", "top"):
        if getattr(args, name) < 1:
            p.error(f"--{name}: must be >= 1, got {getattr(args, name)}")
    for name in ("deadline", "budget"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            p.error(f"--{name}: must be > 0, got {getattr(args, name)}")
    return args


def table(plans: list[sr.Evaluated], steps: int) -> str:
    rows = ["| plan | step s | samples/s | GPU-h per 1k steps | learner GB/dev | generator GB/dev | staleness | "
            "train s | generate s (batch alone) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in plans:
        rows.append(f"| {describe(e.plan)} | {e.step_seconds:.3g} | {e.samples_per_s:.3g} | "
                    f"{e.gpu_hours(1000):.3g} | {e.learner_memory / 1e9:.1f} | {e.generator_memory / 1e9:.1f} | "
                    f"{e.staleness_mean:.2f} | {e.train_seconds:.3g} | {e.generation_seconds:.3g} |")
    return "\n".join(rows)


def main(argv: list[str]) -> int:
    from async_rlhf.plan.model_shapes import parse_size

    args = parse(argv)
    try:
        shape = resolve_model(args.model, args.model_size)
        dev = get_profile(args.gpu_type)
        if args.profile:
            dev = load_profile(args.profile, dev)
        w = Workload(args.prompts_per_step, args.n, args.prompt_length, args.response_mean, args.response_cv,
                     args.response_max, parse_size(args.reward_size) if args.reward_size else None)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cost_aware = args.deadline is not None or args.budget is not None
    counts = None
    if cost_aware:
        step = dev.gpus_per_node if args.nodes > 1 else 1
        counts = [c for c in range(2 if step == 1 else step, args.gpus + 1, step)]
    try:
        plans = sr.search(shape, dev, w, args.gpus, args.nodes, args.any_node_generators, counts,
                          seeds=3 if cost_aware else 1, split=(args.learners, args.generators, args.tp))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"model {shape.name}: {shape.params / 1e9:.3g}B parameters | device {dev.name}: {dev.source}")
    print(f"workload: {w.prompts_per_step} prompts x {w.n} samples per step, prompt {w.prompt_tokens} tokens, "
          f"response mean {w.response_mean:g} (cv {w.response_cv:g}, max {w.response_max}) | PREDICTED, not measured")
    if not plans:
        why = ""
        if args.learners and args.prompts_per_step % args.learners:
            why = f" (--prompts_per_step {args.prompts_per_step} is not divisible by --learners {args.learners})"
        print(f"no plan fits{why}: more devices, a device with more memory, or a smaller model / micro-batch")
        return 1
    print(table(plans[:args.top], args.steps))
    if any(v is not None for v in (args.learners, args.generators, args.tp)):
        by_s = {e.plan.max_staleness: e for e in reversed(plans)}  # the fastest plan of each staleness
        if 0 in by_s and 1 in by_s:
            print(f"asynchronous (S=1) vs synchronous (S=0) on this split: "
                  f"{by_s[0].step_seconds / by_s[1].step_seconds:.2f}x faster")
    chosen = sr.best(plans)
    if cost_aware:
        chosen = sr.cost_aware(plans, args.steps, args.deadline, args.budget)
        if chosen is None:
            print(f"no plan meets --deadline {args.deadline} h / --budget {args.budget} GPU-h for {args.steps} steps")
            return 1
        print(f"cost-aware choice for {args.steps} steps: {chosen.devices} devices, "
              f"{chosen.step_seconds * args.steps / 3600:.3g} h (slowest length draw "
              f"{chosen.worst_step_seconds * args.steps / 3600:.3g} h), {chosen.gpu_hours(args.steps):.3g} GPU-hours")
    print(f"best: {describe(chosen.plan)}: {chosen.step_seconds:.3g} s/step, {chosen.samples_per_s:.3g} samples/s")
    if not args.any_node_generators or chosen.plan.nodes == 1:
        print(launch_command(chosen.plan, w, cpu=dev.kind == "cpu"))
    elif dev.kind == "cpu":  # a Ray cluster: actors on any node, weights over the network
        print(ray_any_node_command(chosen.plan, w, dev.gpus_per_node, args.head_address))
    else:  # generators on any node: servers, weights over the network to those off node 0
        print(any_node_command(chosen.plan, w, dev.gpus_per_node))
    return 0


if __name__ == "__main__":  # also runnable as a file
    sys.exit(main(sys.argv[1:]))
