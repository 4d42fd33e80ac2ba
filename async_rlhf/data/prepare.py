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
  the others wait and then read the finished cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import LlamaForSequenceClassification, PreTrainedModel, PreTrainedTokenizerFast

from async_rlhf.data import builtin_task
from async_rlhf.data.tokenizer import build_tokenizer
from async_rlhf.evaluation import TransformersSampler, evaluate_policy
from async_rlhf.models import tiny_llama
from async_rlhf.types import SamplingSettings

logger = logging.getLogger(__name__)


@dataclass
class SFTSettings:
    seed: int = 0  # task seed (which posts) and training seed
    num_examples: int = 8192  # demonstrations from the train split
    steps: int = 500  # optimizer steps
    batch_size: int = 64
    learning_rate: float = 2e-3  # peak; linear warm-up over 5% of the steps, then cosine decay to 10%
    hidden_size: int = 128  # the policy: a Llama with this width, 4x wider MLP, head size hidden_size / num_heads
    num_layers: int = 4
    num_heads: int = 4


@dataclass
class RewardModelSettings:
    seed: int = 0
    num_pairs: int = 2048  # pairs sampled from the SFT policy on train prompts (ties in gold are dropped)
    num_eval_pairs: int = 512  # held-out pairs, sampled on validation prompts
    temperature: float = 1.0  # sampling temperature for the pairs
    max_new_tokens: int = 24
    epochs: int = 2
    batch_size: int = 32
    learning_rate: float = 5e-4


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


def train_sft(settings: SFTSettings, tokenizer: PreTrainedTokenizerFast, accelerator=None) -> PreTrainedModel:
    """Train a tiny Llama from scratch on the train split's demonstrations (loss on completion tokens + EOS).

    Under `accelerate launch` each process takes its share of every batch; the returned model is unwrapped."""
    from accelerate import Accelerator

    accelerator = accelerator or Accelerator(cpu=not torch.cuda.is_available())
    data = builtin_task.make_splits(settings.seed, sizes={"train": settings.num_examples, "validation": 0,
                                                          "test": 0})["train"]
    examples = []
    for prompt, completion in zip(data["prompt"], data["completion"]):
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        examples.append((p + c, [-100] * len(p) + c))

    model = tiny_llama(tokenizer, settings.hidden_size, settings.num_layers, settings.num_heads,
                       max_position_embeddings=128, seed=settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.01,
                                  betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_lambda(settings.steps))
    model, optimizer = accelerator.prepare(model, optimizer)
    rng = random.Random(settings.seed)
    per_process = settings.batch_size // accelerator.num_processes
    model.train()
    for step in range(settings.steps):
        batch = rng.sample(examples, settings.batch_size)  # same draw on every rank; each takes its slice
        batch = batch[accelerator.process_index * per_process:(accelerator.process_index + 1) * per_process]
        input_ids, attention_mask = _right_pad([b[0] for b in batch], tokenizer.pad_token_id)
        labels, _ = _right_pad([b[1] for b in batch], -100)
        out = model(input_ids=input_ids.to(accelerator.device), attention_mask=attention_mask.to(accelerator.device),
                    labels=labels.to(accelerator.device))
        accelerator.backward(out.loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == settings.steps - 1:
            logger.info("sft step %d/%d loss %.4f", step, settings.steps, out.loss.item())
    return accelerator.unwrap_model(model)
