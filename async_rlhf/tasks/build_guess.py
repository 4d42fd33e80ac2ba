"""Preparing the guessing task (`data/guess_task.py`) once: its tool-calling tokenizer and an SFT policy warmed up on
random legal episodes, cached in `<cache root>/guess-v<TASK_VERSION>[-seed<seed>]` with the built-in task's
guarantees (`tasks/build_builtin.py`: atomic, locked, rebuilt on a new version) and a progress bar per stage.

The demonstrations are whole episodes run through the same token-in-token-out loop the evaluation and a trainer use
(`data/tool_episodes.py`), with a scripted demonstrator (`guess_task.random_legal_guess`) in the policy's place: each
assistant turn is the ids the chat template gives its message, each tool answer the ids it gets rendered alone. The
loss is on the assistant turns (calls, closing message, EOS); the prompt and the tool answers are context. There is
no reward model: the environment's reward is exact.

    python -m async_rlhf.tasks.build_guess --seed 0
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import asdict

import torch

from async_rlhf.data import guess_task
from async_rlhf.data.tiny_model import tiny_llama
from async_rlhf.data.tool_episodes import TurnTokens, run_episodes
from async_rlhf.tasks import build_progress
from async_rlhf.tasks.build_builtin import SFTSettings, _all_cores, _lr_lambda, _right_pad
from async_rlhf.tasks.cache import _paths, build_once, built_atomically, default_cache_dir
from async_rlhf.tasks.guess_evaluation import (
    MAX_COMPLETION_LENGTH,
    MAX_TOOL_CALLING_ITERATIONS,
    evaluate_guess_policy,
)

MAX_POSITIONS = 512  # the first prompt (about 200 ids, most of it the tool schema) and a 256-id episode
EVAL_EPISODES = 256  # held-out episodes for the manifest's metrics (16 per secret)


SFT_STEPS = 600  # the default SFT policy's steps; `--sft_steps` builds a longer-trained one beside it


def sft_settings(seed: int = 0, steps: int = SFT_STEPS) -> SFTSettings:
    """The SFT policy's settings; `steps` other than the default keep the epochs (demonstrations grow with them)."""
    if steps < 1:
        raise ValueError(f"sft_steps: must be >= 1, got {steps}")
    return SFTSettings(seed=seed, num_examples=max(4096, 4096 * steps // SFT_STEPS), steps=steps, batch_size=32,
                       learning_rate=3e-3, hidden_size=64, num_layers=2, num_heads=2)


def demonstrations(tokenizer, num_episodes: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """(input ids, labels) of `num_episodes` random legal episodes on the train split; labels -100 off the sampled
    ids."""
    rows = list(guess_task.make_split(num_episodes, seed, "train"))
    sample = guess_task.scripted_sampler(TurnTokens(tokenizer), guess_task.random_legal_guess,
                                         random.Random(f"guess-{seed}-demonstrations"))
    episodes = run_episodes(tokenizer, [guess_task.GuessEnv() for _ in rows], rows, sample, MAX_COMPLETION_LENGTH,
                            MAX_TOOL_CALLING_ITERATIONS)
    return [(e.prompt_ids + e.completion_ids,
             [-100] * len(e.prompt_ids) + [t if m else -100 for t, m in zip(e.completion_ids, e.mask)])
            for e in episodes]


def _shared_prompt_length(examples: list[tuple[list[int], list[int]]]) -> int:
    """How many ids every demonstration starts with, all of them prompt (-100 labels): the first prompt's."""
    first = examples[0][0][:next(i for i, t in enumerate(examples[0][1]) if t != -100)]
    if any(ids[:len(first)] != first or any(t != -100 for t in labels[:len(first)]) for ids, labels in examples):
        raise ValueError("the demonstrations do not share their first prompt")
    return len(first)


def train_sft(settings: SFTSettings, tokenizer, stage: tuple[int, int] = (1, 1)):
    """A tiny Llama trained from scratch on the demonstrations (`settings.num_examples` episodes)."""
    examples = demonstrations(tokenizer, settings.num_examples, settings.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = tiny_llama(tokenizer, settings.hidden_size, settings.num_layers, settings.num_heads,
                       max_position_embeddings=MAX_POSITIONS, seed=settings.seed).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(settings.steps))
    # Every episode starts with the same prompt (the secret is not in it): its keys and values are computed once a
    # step, without gradient, and the batch carries only the rest, from the prompt's last id (whose logits predict
    # the first sampled id). Half the ids a step; the prompt's ids carry no loss either way.
    shared = _shared_prompt_length(examples) - 1
    prefix = torch.tensor([examples[0][0][:shared]], device=device)
    rng = random.Random(settings.seed)
    model.train()
    bar = build_progress.stage(*stage, "training the SFT policy", settings.steps)
    for step in range(settings.steps):
        batch = rng.sample(examples, settings.batch_size)
        input_ids, _ = _right_pad([b[0][shared:] for b in batch], tokenizer.pad_token_id)  # causal: pads unseen
        labels, _ = _right_pad([b[1][shared:] for b in batch], -100)
        with torch.no_grad():
            cache = model(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(batch))
        loss = model(input_ids=input_ids.to(device), labels=labels.to(device), past_key_values=cache).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        if step % 50 == 0 or step == settings.steps - 1:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    bar.close()
    return model.cpu()


def build_into(directory: str, seed: int = 0, sft: SFTSettings | None = None,
               eval_episodes: int = EVAL_EPISODES) -> dict:
    """Tokenizer, SFT policy and manifest (held-out success and turns on the task and on the control) into
    `directory` (no locking, no atomic rename)."""
    sft = sft or sft_settings(seed)
    paths = _paths(directory)
    start = time.perf_counter()
    tokenizer = guess_task.build_tokenizer(MAX_POSITIONS * 2)
    tokenizer.save_pretrained(paths["tokenizer"])
    t = time.perf_counter()
    policy = train_sft(sft, tokenizer, stage=(1, 2))
    policy.save_pretrained(paths["sft_model"])
    tokenizer.save_pretrained(paths["sft_model"])
    sft_seconds = time.perf_counter() - t
    t = time.perf_counter()
    metrics = {}
    with build_progress.stage(2, 2, "evaluating the SFT policy (held-out episodes)", 2, unit="env") as bar:
        for env in ("guess", "control"):
            metrics[env] = evaluate_guess_policy(policy, tokenizer, env, eval_episodes, seed)
            bar.update(1)
    manifest = {
        "task_version": guess_task.TASK_VERSION,
        "task": guess_task.NAME,
        "seed": seed,
        "sft_settings": asdict(sft),
        "sft_success_rate": metrics["guess"]["success_rate"],
        "sft_turns_mean": metrics["guess"]["turns_mean"],
        "sft_guesses_to_solve_mean": metrics["guess"]["guesses_to_solve_mean"],
        "control_success_rate": metrics["control"]["success_rate"],
        "chance": guess_task.CHANCE,
        "sft_eval": metrics,
        "timings": {"sft_seconds": sft_seconds, "sft_eval_seconds": time.perf_counter() - t,
                    "total_seconds": time.perf_counter() - start},
        "torch_threads": torch.get_num_threads(),
    }
    with open(paths["manifest"], "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def guess_cache_dir(seed: int = 0, sft_steps: int = SFT_STEPS) -> str:
    """Where the task of `seed` with an SFT policy of `sft_steps` is cached: the default policy's directory, or
    beside it with `-sft<steps>`."""
    base = default_cache_dir(seed, guess_task)
    return base if sft_steps == SFT_STEPS else f"{base}-sft{sft_steps}"


def prepare_guess(cache_dir: str | None = None, seed: int = 0, sft: SFTSettings | None = None,
                  eval_episodes: int = EVAL_EPISODES, sft_steps: int = SFT_STEPS) -> dict:
    """Make sure the guessing task's tokenizer and SFT policy exist; return their paths ({"cache_dir", "tokenizer",
    "sft_model", "manifest", ...}). `sft` overrides the settings (tests build a reduced one); `sft_steps` other than
    the default trains the policy longer, cached beside the default one (`<default cache dir>-sft<steps>`)."""
    if cache_dir is None and sft is None:
        cache_dir = guess_cache_dir(seed, sft_steps)
    sft = sft or sft_settings(seed, sft_steps)
    cache_dir = os.path.abspath(cache_dir or default_cache_dir(seed, guess_task))

    def build(directory: str) -> None:
        build_progress.announce(f"Building the guessing task once into {cache_dir}: tokenizer, SFT policy of "
                                f"{sft.steps} steps (17 minutes measured for {SFT_STEPS} on 2 busy CPU cores; "
                                f"later runs reuse it)")
        with (built_atomically(directory) as tmp, _all_cores(), build_progress.without_library_bars(),
              build_progress.building("guessing task")):
            manifest = build_into(tmp, seed, sft, eval_episodes)
        build_progress.announce(f"The guessing task ready in {manifest['timings']['total_seconds']:.0f} s: SFT "
                                f"held-out success {manifest['sft_success_rate']:.3f} in "
                                f"{manifest['sft_turns_mean']:.2f} turns, control {manifest['control_success_rate']:.3f}"
                                f" (chance {guess_task.CHANCE:.3f})")

    return build_once(cache_dir, guess_task, build)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Build the guessing task's tokenizer and SFT policy once (cached).")
    parser.add_argument("--seed", type=int, default=0, help="task seed: which demonstrations, which held-out rows")
    parser.add_argument("--cache_dir", default=None, help="default: <cache root>/guess-v<TASK_VERSION>[-seed<seed>]"
                                                           "[-sft<steps>]")
    parser.add_argument("--sft_steps", type=int, default=SFT_STEPS,
                        help=f"SFT steps of 32 episodes (default {SFT_STEPS}); others keep the epochs")
    args = parser.parse_args(argv)
    paths = prepare_guess(args.cache_dir, args.seed, sft_steps=args.sft_steps)
    with open(paths["manifest"]) as f:
        print(json.dumps({**paths, "manifest": json.load(f)}, indent=2))
    return paths


if __name__ == "__main__":
    main()
