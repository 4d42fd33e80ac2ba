"""Elastic generators (`generator_autoscale`) against one fixed generator, on a generation-bound workload.

    python benchmarks/autoscale.py [--steps 150] [--backend vllm] [--staleness 0] [--cost 0.5]

Both runs train the same tiny policy on the toy task (one learner process, one CPU thread; generators one thread
each), with long completions so that the learner waits for the generators. The fixed run has one generator; the
autoscaled one starts with one and may add one on a spare `cpu` device (`--generator_autoscale_devices cpu`) by the
cost rule of `async_rlhf/experimental/autoscale_rule.py` with `--cost` as a generator device's price. Times are of the
training loop (the first generator's start excluded; the added generator starts while the run goes on). Prints, per
run, the learner's wait fraction and samples/s over the whole loop, and for the autoscaled run the same per window,
with 1 and with 2 generators, and its decisions.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(autoscale: bool, args, model_dir: str) -> dict:
    import torch

    from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
    from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

    torch.set_num_threads(1)
    out = tempfile.mkdtemp(prefix=f"bench-autoscale-{int(autoscale)}-")
    extra = dict(generator_autoscale=True, generator_autoscale_devices=["cpu"], generator_autoscale_cost=args.cost,
                 generator_autoscale_window=args.window) if autoscale else {}
    config = AsyncOnlineDPOConfig(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch, num_generations=2,
        max_new_tokens=args.new_tokens, max_length=args.new_tokens + 32, learning_rate=1e-4, temperature=1.0,
        max_staleness=args.staleness, generator_backend=args.backend, generator_threads=1, learner_threads=1,
        logging_steps=1000, seed=0, disable_tqdm=True, **extra)
    trainer = AsyncOnlineDPOTrainer(model=model_dir, reward_funcs=lowercase_reward, args=config,
                                    train_dataset=toy_prompts(max(512, args.steps * args.batch), seed=0))
    trainer.train()
    return trainer.run_summary


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--new_tokens", type=int, default=96)
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--cost", type=float, default=0.5, help="generator device price relative to a learner device")
    p.add_argument("--window", type=int, default=4, help="steps per autoscaling decision")
    p.add_argument("--backend", default="vllm", choices=["vllm", "transformers"])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    args = p.parse_args(argv)
    load = os.getloadavg()[0]

    from async_rlhf.data.tiny_model import save_tiny_model

    model_dir = save_tiny_model(tempfile.mkdtemp(prefix="bench-model-"), hidden_size=args.hidden,
                                num_layers=args.layers, num_heads=max(2, args.hidden // 32))
    fixed, elastic = run(False, args, model_dir), run(True, args, model_dir)
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, 1-min load before "
          f"{load:.2f}, after {os.getloadavg()[0]:.2f}; backend {args.backend}; policy hidden {args.hidden} x "
          f"{args.layers} layers; "
          f"{args.steps} steps x {args.batch} prompts x 2 samples x <= {args.new_tokens} tokens; max_staleness "
          f"{args.staleness}; generator price {args.cost}; window {args.window} steps")
    print(f"{'run':<26}{'loop s':>8}{'wait frac':>11}{'samples/s':>11}  staleness")
    for name, s in (("fixed, 1 generator", fixed), ("autoscale (1 + spare cpu)", elastic)):
        print(f"{name:<26}{s['loop_seconds']:>8.1f}{s['wait_seconds'] / s['loop_seconds']:>11.2f}"
              f"{s['samples'] / s['loop_seconds']:>11.1f}  {s['staleness_histogram']}")
    a = elastic["generator_autoscale"]
    samples_per_step = args.batch * 2
    for k in sorted({w["generators"] for w in a["windows"]}):
        ws = [w for w in a["windows"] if w["generators"] == k]
        secs = sum(w["step_seconds"] for w in ws) / len(ws)
        wait = sum(w["wait_fraction"] for w in ws) / len(ws)
        print(f"  autoscaled run, windows with {k} generator(s): {len(ws)} windows, {secs:.3f} s/step, wait fraction "
              f"{wait:.2f}, {samples_per_step / secs:.1f} samples/s")
    for e in a["events"]:
        print(f"  step {e['step']}: {e['action']} generator {e['generator_id']} on {e['device']} ({e['reason']})")
    print(f"  what each generator answered (parts, oldest version): {a['answered']}")
    print(f"speed-up, whole loop: {fixed['loop_seconds'] / elastic['loop_seconds']:.2f}x")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
