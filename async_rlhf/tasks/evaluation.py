"""Evaluating a policy the way the paper does: gold win-rate against reference summaries, and KL to the SFT model.

For each held-out prompt the policy writes one near-greedy completion (greedy by default; the paper samples at
temperature 0.01). Then:
- `gold_win_rate`: fraction of prompts where the gold reward scores the policy's completion above the reference
  summary (ties count one half);
- `gold_reward`: mean gold reward of the policy's completions (`reference_gold_reward` is the references' mean);
- `gold_win_rate_vs_sft` (only when baseline completions are given, `sft_completions=`): the same comparison
  against the SFT policy's own greedy completions of the same prompts, what RLHF papers report as win-rate vs SFT;
  it still measures progress where the SFT policy is far below the references (0.5 for the SFT policy itself).
  `gold_evaluation(sft_completions_file=...)` generates them once and caches them (`sft_baseline`);
- `kl`: mean over completions of the sequence log-ratio log pi(y|x) - log pi_sft(y|x), both by teacher forcing
  at temperature 1 on the policy's own samples;
- `sft_perplexity`: exp of the SFT model's mean per-token negative log-likelihood of those completions (EOS
  included when sampled), the paper's "KL (perplexity)" column.

Sampling goes through a `GeneratorBackend` (see `generation/engine/backend.py`): by default `TransformersSampler`
(`generation/engine/hf_backend.py`) over the in-memory policy; any other backend with the same `generate` (vLLM) can be
passed as `backend=`. Log-probs are always recomputed here with the transformers model, so every backend is
measured the same way.

`gold_evaluation` is the one builder of a task's evaluation function: the recipes (at the end and every
`gold_eval_steps`), `evals/evaluate.py` and the sweeps all evaluate through it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from async_rlhf.generation.engine.backend import GeneratorBackend
from async_rlhf.generation.engine.hf_backend import TransformersSampler
from async_rlhf.types import SamplingSettings

RewardFunction = Callable[..., list[float]]


@torch.no_grad()
def completion_logprobs(model: PreTrainedModel, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        pad_token_id: int, batch_size: int = 64) -> list[list[float]]:
    """Per-token log pi(completion token | prompt, earlier tokens) at temperature 1, by teacher forcing.

    Returns [N][T_i] floats, one per completion token."""
    model.eval()
    device = next(model.parameters()).device
    out: list[list[float]] = []
    for start in range(0, len(prompt_ids), batch_size):
        prompts, comps = prompt_ids[start:start + batch_size], completion_ids[start:start + batch_size]
        seqs = [p + c for p, c in zip(prompts, comps)]
        width = max(len(s) for s in seqs)
        input_ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, s in enumerate(seqs):  # right padding: positions match the unpadded sequence
            input_ids[i, :len(s)] = torch.tensor(s)
            attention_mask[i, :len(s)] = 1
        logits = model(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device)).logits.float()
        logps = logits[:, :-1].log_softmax(-1).gather(-1, input_ids[:, 1:, None].to(device)).squeeze(-1)  # [B, L-1]
        for i, (p, c) in enumerate(zip(prompts, comps)):
            out.append(logps[i, len(p) - 1:len(p) - 1 + len(c)].tolist())
    return out


def _load(model_or_path, dtype=torch.float32) -> PreTrainedModel:
    if isinstance(model_or_path, PreTrainedModel):
        return model_or_path
    return AutoModelForCausalLM.from_pretrained(model_or_path, dtype=dtype)


def evaluate_policy(
    model_or_path: PreTrainedModel | str,
    sft_model_path: PreTrainedModel | str | None,
    num_prompts: int = 256,
    seed: int = 0,
    *,
    dataset=None,
    reward_fn: RewardFunction | None = None,
    tokenizer=None,
    backend: GeneratorBackend | None = None,
    max_new_tokens: int = 24,
    temperature: float = 0.0,
    batch_size: int = 128,
    sft_completions: list[dict] | None = None,
) -> dict:
    """Gold win-rate, gold reward and KL to the SFT model of one policy on held-out prompts.

    model_or_path: the policy (a transformers causal LM or a path to one saved with its tokenizer).
    sft_model_path: the SFT model (or a path) that KL and perplexity are measured against; None skips them.
    dataset: rows with `prompt` (text or chat messages) and `reference` columns; default: the built-in task's
        test split for `seed`. The first `num_prompts` rows are used.
    reward_fn: the gold reward, TRL signature; default: the built-in task's `gold_reward`.
    tokenizer: default: the one saved with the policy (or with the SFT model, for an in-memory policy).
    backend: what samples the completions; default `TransformersSampler` over the policy.
    sft_completions: the baseline for `gold_win_rate_vs_sft`, one {"completion", "truncated"} per evaluated prompt
        (what `sft_baseline` returns); None: no such metric.
    Returns a dict of floats and counts (see the module docstring for what each metric means).
    """
    from async_rlhf.data import builtin_task

    start = time.perf_counter()
    policy = _load(model_or_path)
    if tokenizer is None:
        source = model_or_path if isinstance(model_or_path, str) else sft_model_path
        if not isinstance(source, str):
            source = policy.config._name_or_path
        tokenizer = AutoTokenizer.from_pretrained(source)
    if dataset is None:
        dataset = builtin_task.make_splits(seed, sizes={"train": 0, "validation": 0, "test": num_prompts})["test"]
    reward_fn = reward_fn or builtin_task.gold_reward
    rows = dataset.select(range(min(num_prompts, len(dataset))))
    prompts, references = list(rows["prompt"]), list(rows["reference"])

    prompt_ids, samples = _sample(policy, tokenizer, prompts, backend, max_new_tokens, temperature, seed, batch_size)
    completions = [tokenizer.decode(s.token_ids, skip_special_tokens=True) for s in samples]
    truncated = [s.finish_reason == "length" for s in samples]

    policy_scores = _scores(reward_fn, prompts, completions, truncated)
    reference_scores = reward_fn(prompts=prompts, completions=references)
    lengths = [len(s.token_ids) for s in samples]
    metrics = {
        "gold_win_rate": _win_rate(policy_scores, reference_scores),
        "gold_reward": sum(policy_scores) / len(policy_scores),
        "reference_gold_reward": sum(reference_scores) / len(reference_scores),
        "kl": float("nan"),
        "sft_perplexity": float("nan"),
        "completion_tokens_mean": sum(lengths) / len(lengths),
        "truncated_fraction": sum(truncated) / len(truncated),
        "num_prompts": len(prompts),
    }
    if sft_completions is not None:
        if len(sft_completions) != len(prompts):
            raise ValueError(f"sft_completions: {len(sft_completions)} completions for {len(prompts)} prompts")
        sft_scores = _scores(reward_fn, prompts, [c["completion"] for c in sft_completions],
                             [c["truncated"] for c in sft_completions])
        metrics["gold_win_rate_vs_sft"] = _win_rate(policy_scores, sft_scores)
        metrics["sft_gold_reward"] = sum(sft_scores) / len(sft_scores)
    if sft_model_path is not None:
        sft = _load(sft_model_path)
        completion_ids = [s.token_ids for s in samples]
        policy_logps = completion_logprobs(policy, prompt_ids, completion_ids, tokenizer.pad_token_id, batch_size)
        sft_logps = completion_logprobs(sft, prompt_ids, completion_ids, tokenizer.pad_token_id, batch_size)
        ratios = [sum(a) - sum(b) for a, b in zip(policy_logps, sft_logps)]
        sft_nll = -sum(sum(b) for b in sft_logps) / max(1, sum(lengths))
        metrics["kl"] = sum(ratios) / len(ratios)
        metrics["sft_perplexity"] = math.exp(sft_nll)
    metrics["seconds"] = time.perf_counter() - start
    metrics["examples"] = [
        {"prompt": p if isinstance(p, str) else p[-1]["content"], "completion": c, "reference": r}
        for p, c, r in list(zip(prompts, completions, references))[:3]
    ]
    return metrics


def _sample(policy, tokenizer, prompts: list, backend, max_new_tokens: int, temperature: float, seed: int,
            batch_size: int):
    """Token ids of the prompts (chat prompts through the template) and one completion `Sample` per prompt."""
    conversational = not isinstance(prompts[0], str)
    texts = [tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False) if conversational else p
             for p in prompts]
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    backend = backend or TransformersSampler(policy, tokenizer.pad_token_id, tokenizer.eos_token_id, batch_size)
    settings = SamplingSettings(max_new_tokens=max_new_tokens, temperature=temperature, n=1, seed=seed)
    return prompt_ids, [group[0] for group in backend.generate(prompt_ids, settings)]


def _scores(reward_fn: RewardFunction, prompts: list, completions: list[str], truncated: list[bool]) -> list[float]:
    """Gold reward of text completions (wrapped as assistant messages for chat prompts)."""
    if not isinstance(prompts[0], str):
        completions = [[{"role": "assistant", "content": c}] for c in completions]
    return reward_fn(prompts=prompts, completions=completions, truncated=truncated)


def _win_rate(scores: list[float], baseline: list[float]) -> float:
    """Fraction of prompts where `scores` beats `baseline`, ties counting one half."""
    return sum((a > b) + 0.5 * (a == b) for a, b in zip(scores, baseline)) / len(scores)


def sft_baseline(sft_model, tokenizer, dataset, num_prompts: int, max_new_tokens: int, path: str,
                 seed: int = 0) -> list[dict]:
    """The SFT policy's greedy completions of the first `num_prompts` prompts of `dataset`, generated once (in this
    process, with transformers) and cached in the JSON file `path`, keyed by the prompts and `max_new_tokens`: a
    file for other prompts or another budget is regenerated and replaced (atomically). Returns one
    {"completion", "truncated"} per prompt, the `sft_completions` of `evaluate_policy`."""
    prompts = list(dataset.select(range(min(num_prompts, len(dataset))))["prompt"])
    key = {"prompts_sha256": hashlib.sha256(json.dumps(prompts, sort_keys=True).encode()).hexdigest(),
           "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "decoding": "greedy"}
    if os.path.exists(path):
        with open(path) as f:
            cached = json.load(f)
        if cached.get("key") == key:
            return cached["completions"]
    policy = _load(sft_model)
    _, samples = _sample(policy, tokenizer, prompts, None, max_new_tokens, 0.0, seed, 128)
    completions = [{"completion": tokenizer.decode(s.token_ids, skip_special_tokens=True),
                    "truncated": s.finish_reason == "length"} for s in samples]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"key": key, "completions": completions}, f)
    os.replace(tmp, path)
    return completions


@contextlib.contextmanager
def whole_models():
    """Models loaded inside load whole, never partitioned by DeepSpeed ZeRO-3's `zero.Init`: an evaluation runs on rank
    0 alone, and `zero.Init` is a collective the other ranks never join (transformers applies it to every
    `from_pretrained` while a ZeRO-3 run's config is registered: rank 0's evaluation after a ZeRO-3 run failed on it)."""
    from transformers.integrations import deepspeed as hf_deepspeed

    ref = hf_deepspeed._hf_deepspeed_config_weak_ref  # the registered config, if any (weakly held)
    config = ref() if ref is not None else None
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        if config is not None:
            hf_deepspeed.set_hf_deepspeed_config(config)


def gold_evaluation(reference_model: str, tokenizer_path: str | None, dataset, num_prompts: int,
                    max_new_tokens: int = 24, seed: int = 0,
                    backend_for: Callable[[str], GeneratorBackend | None] | None = None,
                    reward_fn: RewardFunction | None = None, sft_completions_file: str | None = None,
                    temperature: float = 0.0):
    """A task's evaluation function `evaluate(model_or_dir) -> metrics`, or None when `num_prompts` is 0.

    reference_model: the model KL and SFT perplexity are measured against, read once (with the tokenizer) at the
        first evaluation, not at every one.
    tokenizer_path: the task's tokenizer; None: the evaluated directory's own.
    dataset: rows with `prompt` and `reference`; its first `num_prompts` rows are evaluated.
    backend_for(directory): an engine to sample a saved policy with (closed after); None or a None result:
        transformers in this process.
    reward_fn: the task's gold reward (default: the built-in task's).
    sft_completions_file: where the SFT policy's (`reference_model`'s) greedy completions are cached
        (`sft_baseline`); given, every evaluation also reports `gold_win_rate_vs_sft`.
    temperature: 0 (default) greedy, as the paper; 1 measures the policy that samples (the sorting task, whose SFT
        policy is right 91% of the time greedily), seeded by `seed`."""
    if num_prompts <= 0:
        return None
    loaded = {}

    def evaluate(model_or_dir):
        with whole_models():
            return _evaluate(model_or_dir)

    def _evaluate(model_or_dir):
        if not loaded:
            loaded["tokenizer"] = AutoTokenizer.from_pretrained(tokenizer_path) if tokenizer_path else None
            loaded["reference"] = AutoModelForCausalLM.from_pretrained(reference_model, dtype=torch.float32)
            loaded["sft_completions"] = None
            if sft_completions_file is not None:
                tokenizer = loaded["tokenizer"] or AutoTokenizer.from_pretrained(reference_model)
                loaded["sft_completions"] = sft_baseline(loaded["reference"], tokenizer, dataset, num_prompts,
                                                         max_new_tokens, sft_completions_file, seed)
        engine = backend_for(model_or_dir) if backend_for is not None and isinstance(model_or_dir, str) else None
        try:
            return evaluate_policy(model_or_dir, loaded["reference"], num_prompts=num_prompts, seed=seed,
                                   tokenizer=loaded["tokenizer"], dataset=dataset, max_new_tokens=max_new_tokens,
                                   backend=engine, reward_fn=reward_fn, sft_completions=loaded["sft_completions"],
                                   temperature=temperature)
        finally:
            if engine is not None:
                engine.close()

    return evaluate
