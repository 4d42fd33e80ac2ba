"""Synchronous (max_staleness=0) vs asynchronous (max_staleness=1) online DPO: same samples, one invocation.

    python benchmarks/async_vs_sync.py [--steps 24] [--backend vllm] [--hidden 256 --layers 4]

Each run trains the same tiny policy on the toy task with one learner process and one generator process,
one CPU thread each (so the two stages can really run side by side on a 2-core machine). Engine start-up is
excluded: times are of the training loop. Prints wall times, their ratio, and the ideal ratio
(t_gen + t_train) / max(t_gen, t_train) computed from the stage times measured in the synchronous run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(staleness: int, args, model_dir: str) -> dict:
    import torch

    from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
    from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

    torch.set_num_threads(args.learner_threads)
    out = tempfile.mkdtemp(prefix=f"bench-s{staleness}-")
    config = AsyncOnlineDPOConfig(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=args.batch, num_generations=2,
        max_new_tokens=args.new_tokens, max_length=args.new_tokens + 32, learning_rate=1e-4, temperature=1.0,
        max_staleness=staleness, generator_backend=args.backend, generator_threads=args.generator_threads,
        logging_steps=1000, seed=0, disable_tqdm=True,
    )
    trainer = AsyncOnlineDPOTrainer(model=model_dir, reward_funcs=lowercase_reward, args=config,
                                    train_dataset=toy_prompts(max(512, args.steps * args.batch), seed=0))
    trainer.train()
    return trainer.run_summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=16, help="prompts per step")
    p.add_argument("--new_tokens", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backend", default="vllm", choices=["vllm", "transformers"])
    p.add_argument("--learner_threads", type=int, default=1)
    p.add_argument("--generator_threads", type=int, default=1)
    args = p.parse_args()

    from async_rlhf.data.tiny_model import save_tiny_model

    model_dir = save_tiny_model(tempfile.mkdtemp(prefix="bench-model-"), hidden_size=args.hidden,
                                num_layers=args.layers, num_heads=4)
    sync, asyn = run(0, args, model_dir), run(1, args, model_dir)
    t_gen, t_train = sync["generate_seconds"], sync["train_seconds"]
    ideal = (t_gen + t_train) / max(t_gen, t_train)
    speedup = sync["loop_seconds"] / asyn["loop_seconds"]
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; backend {args.backend}; "
          f"policy hidden {args.hidden} x {args.layers} layers; {args.steps} steps x {args.batch} prompts x 2 "
          f"samples x <= {args.new_tokens} tokens; learner {args.learner_threads} thread(s), generator "
          f"{args.generator_threads} thread(s)")
    print(f"{'run':<22}{'loop s':>9}{'gen s':>9}{'train s':>9}{'wait s':>9}{'sync s':>9}  staleness")
    for name, s in (("sync  (max_staleness 0)", sync), ("async (max_staleness 1)", asyn)):
        print(f"{name:<22}{s['loop_seconds']:>9.1f}{s['generate_seconds']:>9.1f}{s['train_seconds']:>9.1f}"
              f"{s['wait_seconds']:>9.1f}{s['sync_seconds'] + s['sync_load_seconds']:>9.2f}  "
              f"{s['staleness_histogram']}")
    print(f"speed-up sync/async wall: {speedup:.2f}x | ideal (t_gen + t_train) / max(t_gen, t_train): {ideal:.2f}x "
          f"| achieved {100 * (speedup - 1) / (ideal - 1) if ideal > 1 else 100:.0f}% of the ideal gain, "
          f"{100 * speedup / ideal:.0f}% of the ideal ratio")


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "disabled")
    main()
