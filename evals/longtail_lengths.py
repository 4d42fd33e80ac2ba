"""Completion lengths of the long-tail task: the targets, and what a policy samples.

    python evals/longtail_lengths.py                                  # the prepared SFT policy, 512 test prompts
    python evals/longtail_lengths.py --model_name_or_path outputs/online_dpo_longtail --num_prompts 256

Prints JSON: for the ideal summaries, the references and the SFT demonstrations of the test prompts (token counts
with EOS), and for the policy's samples (`--samples_per_prompt` at `--temperature`, as the recipes sample, and one
greedy completion per prompt, as the gold evaluation does): mean, coefficient of variation, median, 99th
percentile, max, the mean over groups of 16 of the longest (a small step's wait on its longest sample, in units of
the mean), and the fraction cut at 256 tokens. Sampled with transformers in this process.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def length_stats(lengths: list[int], cap: int | None = None) -> dict:
    ordered = sorted(lengths)
    mean = statistics.mean(lengths)
    groups = [lengths[i:i + 16] for i in range(0, len(lengths) - 15, 16)]
    stats = {"n": len(lengths), "mean": round(mean, 1), "cv": round(statistics.pstdev(lengths) / mean, 2),
             "median": ordered[len(ordered) // 2], "p99": ordered[int(0.99 * (len(ordered) - 1))], "max": ordered[-1],
             "longest_of_16_over_mean": round(statistics.mean(max(g) for g in groups) / mean, 2) if groups else None}
    if cap is not None:
        stats["cut_at_cap"] = round(sum(n >= cap for n in lengths) / len(lengths), 3)
    return stats


def main(argv: list[str]) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model_name_or_path", default=None, help="Policy (default: the prepared SFT policy).")
    parser.add_argument("--num_prompts", type=int, default=512)
    parser.add_argument("--samples_per_prompt", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from async_rlhf.data import longtail_task as lt
    from async_rlhf.tasks.build_longtail import prepare_longtail
    from async_rlhf.generation.engine.hf_backend import TransformersSampler
    from async_rlhf.types import SamplingSettings

    paths = prepare_longtail()
    tokenizer = AutoTokenizer.from_pretrained(paths["tokenizer"])
    test = lt.make_splits(0, sizes={"train": 0, "validation": 0, "test": args.num_prompts})["test"]

    def tokens(texts):
        return [len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in texts]  # + EOS

    posts = [lt.Post("", tuple(lt.post_words(p))) for p in test["prompt"]]
    out = {"ideal": length_stats(tokens([lt.ideal_summary(p) for p in posts])),
           "references": length_stats(tokens(test["reference"])),
           "demonstrations": length_stats(tokens(test["completion"]))}
    policy = AutoModelForCausalLM.from_pretrained(args.model_name_or_path or paths["sft_model"], dtype=torch.float32)
    sampler = TransformersSampler(policy, tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in test["prompt"]]
    order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # batches decode to their longest
    for name, n, temperature in (("sampled", args.samples_per_prompt, args.temperature), ("greedy", 1, 0.0)):
        settings = SamplingSettings(max_new_tokens=lt.MAX_NEW_TOKENS, temperature=temperature, n=n, seed=args.seed)
        groups = sampler.generate([prompt_ids[i] for i in order], settings)
        by_prompt = dict(zip(order, groups))
        lengths = [len(c.token_ids) for i in range(len(order)) for c in by_prompt[i]]  # EOS counted when sampled
        out[f"policy_{name}"] = {**length_stats(lengths, cap=lt.MAX_NEW_TOKENS), "temperature": temperature}
    print(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
