"""Reference log-probs and reward-model scores with and without the shared prompt prefix (`reference_shared_prefix`,
`reward_shared_prefix`), at n = 2, 4, 8.

    python benchmarks/shared_prefix.py                 # built-in task's SFT model and prompts (built on first use)
    python benchmarks/shared_prefix.py --prompts 32 --repeats 5 --threads 1

Per n: the built-in task's first `--prompts` training prompts, n completions each sampled from the SFT policy at
temperature 1 (max 24 tokens), then the frozen-model forward that the learner runs every step, timed both ways
in the same process (median of `--repeats` after a warm-up): `token_logps` over the packed prompt + completion
rows (unshared), and `shared_prefix_logps` (each prompt once, its key/value cache expanded to its n rows). Also
prints the largest difference between the two (float tolerance) and the tokens each way runs through the model.
Then the same completions, decoded, through the built-in reward model as the scoring thread runs it
(`RewardScorer._model_scores` on prompt + completion text: tokenizing included, the same both ways), padded
(`reward_shared_prefix` false) and with each prompt's common tokens run once (`scoring/reward_prefix.py`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from weight_load import median_seconds  # noqa: E402  (benchmarks/ is on the path when run as a script)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=32, help="prompts per step (the default run's 32)")
    parser.add_argument("--ns", type=int, nargs="+", default=[2, 4, 8], help="completions per prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the learner's share of 2 cores)")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from async_rlhf.data.builtin_task import make_splits
    from async_rlhf.tasks.build_builtin import prepare_builtin
    from async_rlhf.generation.engine.hf_backend import TransformersSampler
    from async_rlhf.learner.logprobs import completion_batch, shared_prefix_logps, token_logps
    from async_rlhf.scoring.rewards import RewardScorer
    from async_rlhf.types import SamplingSettings, ScoredGroup

    torch.set_num_threads(args.threads)
    paths = prepare_builtin(seed=0)
    tok = AutoTokenizer.from_pretrained(paths["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(paths["sft_model"], dtype=torch.float32).eval()
    rows = make_splits(seed=0)["train"].select(range(args.prompts))
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in rows["prompt"]]
    max_length = 512
    print(f"model {paths['sft_model']} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters), "
          f"{args.prompts} prompts of {statistics.mean(len(p) for p in prompts):.1f} tokens on average, "
          f"{args.threads} thread(s)")
    print(f"{'n':>3} {'completion tokens':>18} {'tokens unshared':>16} {'tokens shared':>14} {'unshared s':>11} "
          f"{'shared s':>9} {'speed-up':>9} {'max |diff|':>11}")
    results, texts = [], {}
    for n in args.ns:
        sampler = TransformersSampler(model, tok.pad_token_id, tok.eos_token_id)
        samples = sampler.generate(prompts, SamplingSettings(max_new_tokens=24, temperature=1.0, n=n, seed=0))
        groups = [ScoredGroup(i, p, s, [0.0] * n, 0) for i, (p, s) in enumerate(zip(prompts, samples))]
        ids, attn, comp, _ = completion_batch(groups, tok.pad_token_id, max_length, "cpu")
        with torch.no_grad():
            unshared, mask, _ = token_logps(model, ids, attn, comp)
        shared = shared_prefix_logps(model, groups, None, mask, max_length)
        comp_tokens = sum(len(c.token_ids) for s in samples for c in s)
        prompt_tokens = sum(len(p) for p in prompts)
        row = {
            "n": n, "completion_tokens": comp_tokens,
            "tokens_unshared": int(ids.shape[0] * ids.shape[1]),  # padded, as the forward sees them
            "tokens_shared": len(prompts) * max(len(p) for p in prompts) + len(groups) * n * max(
                len(c.token_ids) for s in samples for c in s),
            "unshared_seconds": median_seconds(lambda: _no_grad(token_logps, model, ids, attn, comp), args.repeats),
            "shared_seconds": median_seconds(lambda: shared_prefix_logps(model, groups, None, mask, max_length),
                                             args.repeats),
            "max_abs_diff": float((shared - unshared).abs().max()),
            "prompt_tokens": prompt_tokens,
        }
        row["speed_up"] = row["unshared_seconds"] / row["shared_seconds"]
        results.append(row)
        print(f"{n:>3} {comp_tokens:>18} {row['tokens_unshared']:>16} {row['tokens_shared']:>14} "
              f"{row['unshared_seconds']:>11.4f} {row['shared_seconds']:>9.4f} {row['speed_up']:>8.2f}x "
              f"{row['max_abs_diff']:>11.2e}")
        texts[n] = ([p for p, s in zip(rows["prompt"], samples) for _ in s],
                    [tok.decode(c.token_ids, skip_special_tokens=True) for s in samples for c in s])
    reward = AutoModelForSequenceClassification.from_pretrained(paths["reward_model"], num_labels=1,
                                                                dtype=torch.float32)
    padded, shared = (RewardScorer([reward], reward_processing_classes=[tok], shared_prefix=flag)
                      for flag in (False, True))
    model = padded.funcs[0]
    print(f"reward model {paths['reward_model']} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
          f"parameters), tokenizer padding {tok.padding_side}")
    print(f"{'n':>3} {'rows':>5} {'padded s':>9} {'shared s':>9} {'speed-up':>9} {'max |diff|':>11}")
    for row in results:
        prompts_n, completions_n = texts[row["n"]]
        a = padded._model_scores(model, tok, prompts_n, completions_n)
        b = shared._model_scores(model, tok, prompts_n, completions_n)
        row["reward_padded_seconds"] = median_seconds(
            lambda: padded._model_scores(model, tok, prompts_n, completions_n), args.repeats)
        row["reward_shared_seconds"] = median_seconds(
            lambda: shared._model_scores(model, tok, prompts_n, completions_n), args.repeats)
        row["reward_speed_up"] = row["reward_padded_seconds"] / row["reward_shared_seconds"]
        row["reward_max_abs_diff"] = max(abs(x - y) for x, y in zip(a, b))
        print(f"{row['n']:>3} {len(a):>5} {row['reward_padded_seconds']:>9.4f} {row['reward_shared_seconds']:>9.4f} "
              f"{row['reward_speed_up']:>8.2f}x {row['reward_max_abs_diff']:>11.2e}")
    return results


def _no_grad(fn, *args):
    import torch

    with torch.no_grad():
        return fn(*args)


if __name__ == "__main__":
    main()
