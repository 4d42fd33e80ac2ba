"""Preparing the built-in task once: SFT policy, proxy reward model and tokenizer, cached on disk.

The paper's pipeline before RLHF is: fine-tune a policy on human demonstrations (SFT), sample pairs of
completions from it, label each pair with the gold reward model, and train a proxy reward model on those labels.
`prepare_builtin()` runs the same three steps on the built-in task (`data/builtin_task.py`) in a few minutes on a
laptop CPU and returns the paths the RLHF recipes start from. The steps are also the bodies of
`recipes/sft.py` and `recipes/reward_model.py`, which run them one at a time with command-line settings.

Cache guarantees:
- the cache lives in `<root>/builtin-v<TASK_VERSION>[-seed<seed>]`, root `~/.cache/async_rlhf` or the
  `ASYNC_RLHF_CACHE` environment variable; a new task version gets a new directory, so it is rebuilt;
- a cache directory either holds everything (`manifest.json` is written last) or does not exist: preparation
  writes into a temporary sibling directory and renames it into place, so an interrupted run leaves no half cache;
- concurrent callers (several ranks of `accelerate launch`, two terminals) serialise on a lock file: one builds,
  the others wait (logging every 30 s, at most `BUILD_LOCK_TIMEOUT`, then a TimeoutError naming the lock file)
  and then read the finished cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import random
import time
from dataclasses import asdict, dataclass

import torch
from transformers import AutoModelForCausalLM, LlamaForSequenceClassification, PreTrainedModel, PreTrainedTokenizerFast

from async_rlhf.data import builtin_task
from async_rlhf.data.tiny_model import tiny_llama
from async_rlhf.data.tokenizer import build_tokenizer
from async_rlhf.generation.engine.hf_backend import TransformersSampler
from async_rlhf.tasks import build_progress
from async_rlhf.tasks.cache import _paths, build_once, built_atomically, default_cache_dir
from async_rlhf.tasks.evaluation import evaluate_policy
from async_rlhf.types import SamplingSettings

logger = logging.getLogger(__name__)
SFT_MAX_POSITIONS = 128  # the built-in policy's context (a post and its summary take well under 128 tokens)


@dataclass
class SFTSettings:
    seed: int = 0  # task seed (which posts) and training seed
    num_examples: int = 8192  # demonstrations from the train split
    steps: int = 800  # optimizer steps (about three minutes on two idle CPU cores, one thread: seven)
    batch_size: int = 64
    learning_rate: float = 1e-3  # peak; linear warm-up over 5% of the steps, then cosine decay to 10%
    hidden_size: int = 128  # the policy: a Llama with this width, 4x wider MLP, head size hidden_size / num_heads
    num_layers: int = 4
    num_heads: int = 4
    length_grouped: bool = False  # batches of similar lengths (drawn 8 batches at a time): less padding, long tails


@dataclass
class RewardModelSettings:
    seed: int = 0
    num_pairs: int = 8192  # pairs sampled from the SFT policy on train prompts (ties in gold are dropped)
    num_eval_pairs: int = 512  # held-out pairs, sampled on validation prompts
    temperature: float = 1.0  # sampling temperature for the pairs
    max_new_tokens: int = 24
    epochs: int = 1
    batch_size: int = 32
    learning_rate: float = 3e-4
    sort_prompts: bool = False  # sample pairs for prompts in order of length (a batch decodes to its longest sample)


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


@contextlib.contextmanager
def _all_cores():
    """Build with every core: the other ranks wait on the lock meanwhile, and `accelerate launch --cpu` may have
    left this process one thread (measured: SFT 406 s with 1 thread, 193 s with 2 on two idle cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _lr_lambda(total: int):
    warmup = max(1, total // 20)

    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def _right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


def _length_grouped(examples: list, batch_size: int, rng: random.Random):
    """Endless batches: draw 8 batches' worth of examples, sort them by length, cut, and yield in random order."""
    while True:
        pool = sorted(rng.sample(examples, 8 * batch_size), key=lambda e: len(e[0]))
        batches = [pool[i:i + batch_size] for i in range(0, len(pool), batch_size)]
        rng.shuffle(batches)
        yield from batches


def train_sft(settings: SFTSettings, tokenizer: PreTrainedTokenizerFast, accelerator=None,
              stage: tuple[int, int] = (1, 1), task=builtin_task,
              max_positions: int = SFT_MAX_POSITIONS) -> PreTrainedModel:
    """Train a tiny Llama from scratch on the train split's demonstrations (loss on completion tokens + EOS).

    `task`: the task module (`builtin_task`, `longtail_task`). Under `accelerate launch` each process takes its
    share of every batch; the returned model is unwrapped."""
    from accelerate import Accelerator

    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    data = task.make_splits(settings.seed, sizes={"train": settings.num_examples, "validation": 0,
                                                          "test": 0})["train"]
    examples = []
    for prompt, completion in zip(data["prompt"], data["completion"]):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((p + c, [-100] * len(p) + c))

    model = tiny_llama(tokenizer, settings.hidden_size, settings.num_layers, settings.num_heads,
                       max_position_embeddings=max_positions, seed=settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(settings.steps))
    model, optimizer = accelerator.prepare(model, optimizer)
    rng = random.Random(settings.seed)
    per_process = settings.batch_size // accelerator.num_processes
    grouped = _length_grouped(examples, settings.batch_size, rng) if settings.length_grouped else None
    model.train()
    bar = build_progress.stage(*stage, "training the SFT policy", settings.steps)
    for step in range(settings.steps):
        # the same draw on every rank; each takes its slice
        batch = next(grouped) if grouped else rng.sample(examples, settings.batch_size)
        batch = batch[accelerator.process_index * per_process:(accelerator.process_index + 1) * per_process]
        # Right padding needs no attention mask: causal attention never lets a real token see the pads after it.
        input_ids, _ = _right_pad([b[0] for b in batch], tokenizer.pad_token_id)
        labels, _ = _right_pad([b[1] for b in batch], -100)
        out = model(input_ids=input_ids.to(accelerator.device), labels=labels.to(accelerator.device))
        accelerator.backward(out.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        bar.update(1)
        if step % 100 == 0 or step == settings.steps - 1:
            bar.set_postfix(loss=f"{out.loss.item():.3f}", refresh=False)
            logger.info("sft step %d/%d loss %.4f", step, settings.steps, out.loss.item())
    bar.close()
    return accelerator.unwrap_model(model)


def sample_preference_pairs(policy: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, split: str, num_prompts: int,
                            settings: RewardModelSettings, on_batch=None, task=builtin_task) -> dict[str, list]:
    """Two completions per prompt from `policy`, labelled by the gold reward; pairs the gold scores tie are dropped.

    Returns columns `prompt`, `chosen`, `rejected` (texts) and `margin` (gold chosen - gold rejected)."""
    rows = task.make_split(num_prompts, settings.seed, split)
    prompts = list(rows["prompt"])
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if settings.sort_prompts:
        order = sorted(range(len(prompts)), key=lambda i: len(prompt_ids[i]))
        prompts, prompt_ids = [prompts[i] for i in order], [prompt_ids[i] for i in order]
    sampler = TransformersSampler(policy, tokenizer.pad_token_id, tokenizer.eos_token_id, on_batch=on_batch)
    sampling = SamplingSettings(max_new_tokens=settings.max_new_tokens, temperature=settings.temperature, n=2,
                                seed=settings.seed)
    pairs: dict[str, list] = {"prompt": [], "chosen": [], "rejected": [], "margin": []}
    for prompt, group in zip(prompts, sampler.generate(prompt_ids, sampling)):
        texts = [tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in group]
        truncated = [c.finish_reason == "length" for c in group]
        a, b = task.gold_reward([prompt] * 2, texts, truncated=truncated)
        if a == b:
            continue
        pairs["prompt"].append(prompt)
        pairs["chosen"].append(texts[0] if a > b else texts[1])
        pairs["rejected"].append(texts[1] if a > b else texts[0])
        pairs["margin"].append(abs(a - b))
    return pairs


@torch.no_grad()
def reward_scores(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, prompts: list[str],
                  completions: list[str], batch_size: int = 64) -> list[float]:
    """The reward model's score of each prompt + completion text (how `scoring/rewards.py` feeds reward models)."""
    model.eval()
    out: list[float] = []
    for start in range(0, len(prompts), batch_size):
        texts = [p + c for p, c in zip(prompts[start:start + batch_size], completions[start:start + batch_size])]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        out += model(**enc).logits[:, 0].float().tolist()
    return out


def pairwise_accuracy(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, pairs: dict[str, list]) -> float:
    chosen = reward_scores(model, tokenizer, pairs["prompt"], pairs["chosen"])
    rejected = reward_scores(model, tokenizer, pairs["prompt"], pairs["rejected"])
    return sum(c > r for c, r in zip(chosen, rejected)) / max(1, len(chosen))


def train_reward_model(settings: RewardModelSettings, sft_model_path: str, tokenizer: PreTrainedTokenizerFast,
                       accelerator=None, stage: tuple[int, int, int] = (1, 2, 2),
                       task=builtin_task) -> tuple[PreTrainedModel, dict]:
    """The paper's proxy reward model: the SFT model with a scalar head, trained with the Bradley-Terry loss
    -log sigmoid(r(x, y_chosen) - r(x, y_rejected)) on SFT samples labelled by the gold reward.

    Returns the (unwrapped) model and metrics: pair counts and held-out pairwise accuracy against gold labels."""
    from accelerate import Accelerator

    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    policy = AutoModelForCausalLM.from_pretrained(sft_model_path, dtype=torch.float32)
    first, second, count = stage  # stage numbers of the sampling and the training, of `count`
    bar = build_progress.stage(first, count, "sampling preference pairs from the SFT policy",
                               settings.num_pairs + settings.num_eval_pairs, unit="prompt")
    train_pairs = sample_preference_pairs(policy, tokenizer, "preference", settings.num_pairs, settings, bar.update,
                                          task)
    eval_pairs = sample_preference_pairs(policy, tokenizer, "validation", settings.num_eval_pairs, settings,
                                         bar.update, task)
    bar.close()
    del policy
    logger.info("reward model: %d train pairs, %d held-out pairs (gold ties dropped)",
                len(train_pairs["prompt"]), len(eval_pairs["prompt"]))

    torch.manual_seed(settings.seed)
    with _quiet_transformers():  # the SFT checkpoint has an lm_head and no score head: expected, not worth a report
        model = LlamaForSequenceClassification.from_pretrained(sft_model_path, num_labels=1, dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    accuracy_before = pairwise_accuracy(model, tokenizer, eval_pairs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01)
    num_pairs = len(train_pairs["prompt"])
    steps = settings.epochs * (num_pairs // settings.batch_size)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(steps))
    model, optimizer = accelerator.prepare(model, optimizer)
    per_process = settings.batch_size // accelerator.num_processes
    rng = random.Random(settings.seed)
    model.train()
    step = 0
    bar = build_progress.stage(second, count, "training the reward model", steps)
    for epoch in range(settings.epochs):
        order = list(range(num_pairs))
        rng.shuffle(order)
        for start in range(0, num_pairs - settings.batch_size + 1, settings.batch_size):
            idx = order[start:start + settings.batch_size]
            idx = idx[accelerator.process_index * per_process:(accelerator.process_index + 1) * per_process]
            prompts = [train_pairs["prompt"][i] for i in idx]
            texts = [p + train_pairs["chosen"][i] for p, i in zip(prompts, idx)]
            texts += [p + train_pairs["rejected"][i] for p, i in zip(prompts, idx)]
            enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(accelerator.device)
            rewards = model(**enc).logits[:, 0]  # [2B]: chosen then rejected
            loss = -torch.nn.functional.logsigmoid(rewards[:len(idx)] - rewards[len(idx):]).mean()
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 50 == 0:
                bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
                logger.info("reward model epoch %d step %d/%d loss %.4f", epoch, step, steps, loss.item())
            step += 1
            bar.update(1)
    bar.close()
    model = accelerator.unwrap_model(model)
    metrics = {
        "train_pairs": num_pairs,
        "eval_pairs": len(eval_pairs["prompt"]),
        "eval_accuracy": pairwise_accuracy(model, tokenizer, eval_pairs),
        "eval_accuracy_at_init": accuracy_before,
        "train_accuracy": pairwise_accuracy(model, tokenizer, {k: v[:512] for k, v in train_pairs.items()}),
    }
    return model, metrics


def build_into(directory: str, seed: int = 0, sft: SFTSettings | None = None,
               reward: RewardModelSettings | None = None, task=builtin_task,
               max_positions: int = SFT_MAX_POSITIONS) -> dict:
    """Build tokenizer, SFT policy and proxy reward model of `task` (a module: `builtin_task`, `longtail_task`) into
    `directory` (no locking, no atomic rename).

    Returns the manifest: task version, settings, metrics (SFT gold win-rate, RM accuracy) and timings."""
    sft = sft or SFTSettings(seed=seed)
    reward = reward or RewardModelSettings(seed=seed)
    paths = _paths(directory)
    timings: dict[str, float] = {}
    start = time.perf_counter()
    tokenizer = build_tokenizer(max(512, max_positions), vocabulary=task.VOCABULARY)
    tokenizer.save_pretrained(paths["tokenizer"])

    t = time.perf_counter()
    proxy = getattr(task, "PROXY_REWARD_MODEL", True)  # a verifiable task trains on its gold reward: no proxy model
    stages = 4 if proxy else 2
    policy = train_sft(sft, tokenizer, stage=(1, stages), task=task, max_positions=max_positions)
    policy.save_pretrained(paths["sft_model"])
    tokenizer.save_pretrained(paths["sft_model"])
    timings["sft_seconds"] = time.perf_counter() - t

    t = time.perf_counter()
    with build_progress.stage(2, stages, "evaluating the SFT policy (gold reward)", 1, unit="pass") as bar:
        test = task.make_splits(seed, sizes={"train": 0, "validation": 0, "test": 256})["test"]
        sft_eval = evaluate_policy(policy, None, num_prompts=256, seed=seed, tokenizer=tokenizer, dataset=test,
                                   reward_fn=task.gold_reward, max_new_tokens=reward.max_new_tokens)
        bar.update(1)
    timings["sft_eval_seconds"] = time.perf_counter() - t
    del policy

    reward_metrics = None
    if proxy:
        t = time.perf_counter()
        reward_model, reward_metrics = train_reward_model(reward, paths["sft_model"], tokenizer, stage=(3, 4, 4),
                                                           task=task)
        reward_model.save_pretrained(paths["reward_model"])
        tokenizer.save_pretrained(paths["reward_model"])
        timings["reward_model_seconds"] = time.perf_counter() - t
    timings["total_seconds"] = time.perf_counter() - start

    manifest = {
        "task_version": task.TASK_VERSION,
        "task": task.NAME,
        "seed": seed,
        "sft_settings": asdict(sft),
        "reward_model_settings": asdict(reward),
        "sft_gold_win_rate": sft_eval["gold_win_rate"],
        "sft_gold_reward": sft_eval["gold_reward"],
        "sft_completion_tokens_mean": sft_eval["completion_tokens_mean"],
        "reference_gold_reward": sft_eval["reference_gold_reward"],
        "reward_model": reward_metrics,
        "timings": timings,
        "torch_threads": torch.get_num_threads(),
    }
    with open(paths["manifest"], "w") as f:
        json.dump(manifest, f, indent=2)
    return manifest


def prepare_builtin(cache_dir: str | None = None, seed: int = 0) -> dict:
    """Make sure the built-in task's tokenizer, SFT policy and proxy reward model exist; return their paths.

    Returns {"cache_dir", "tokenizer", "sft_model", "reward_model", "manifest"}. Skips all work when a finished
    cache of the current `TASK_VERSION` is there; otherwise builds it (a few minutes on two CPU cores)."""
    return prepare_task(builtin_task, cache_dir, seed, what="the built-in task", minutes="2-5")


def prepare_task(task, cache_dir: str | None = None, seed: int = 0, sft: SFTSettings | None = None,
                 reward: RewardModelSettings | None = None, max_positions: int = SFT_MAX_POSITIONS,
                 what: str = "the task", minutes: str = "a few") -> dict:
    """`prepare_builtin` for any task module: the cache guarantees of this module's docstring, in
    `<root>/<task.NAME>-v<task.TASK_VERSION>[-seed<seed>]` unless `cache_dir` is given."""
    cache_dir = os.path.abspath(cache_dir or default_cache_dir(seed, task))

    def build(directory: str) -> None:
        proxy = getattr(task, "PROXY_REWARD_MODEL", True)
        build_progress.announce(f"Building {what} once into {cache_dir}: tokenizer, SFT policy"
                                f"{', proxy reward model' if proxy else ''} ({minutes} minutes on 2 CPU cores; later "
                                f"runs reuse it)")
        label = what.removeprefix("the ")
        with (built_atomically(directory) as tmp, _all_cores(), build_progress.without_library_bars(),
              build_progress.building(label)):
            manifest = build_into(tmp, seed, sft, reward, task, max_positions)
        reward_model = manifest["reward_model"]
        build_progress.announce(f"{what[0].upper() + what[1:]} ready in {manifest['timings']['total_seconds']:.0f} s: "
                                f"SFT gold win-rate {manifest['sft_gold_win_rate']:.3f}, SFT gold reward "
                                f"{manifest['sft_gold_reward']:.3f}" + (
                                    f", reward model held-out accuracy {reward_model['eval_accuracy']:.3f}"
                                    if reward_model else ""))

    return build_once(cache_dir, task, build)
