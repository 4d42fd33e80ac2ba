"""Gold evaluation of saved policies: win-rate against the reference summaries, gold reward, KL to the SFT model.

    python evals/evaluate.py --model_name_or_path outputs/online_dpo [more checkpoints ...] \
        [--sft_model_path PATH] [--num_prompts 256] [--backend auto|vllm|transformers] [--output_file results.json]

Prints one table row per checkpoint and writes JSON (a list, one object per checkpoint) with `gold_win_rate`,
`gold_reward`, `reference_gold_reward`, `kl`, `sft_perplexity` and more (see `async_rlhf/tasks/evaluation.py`, which the
trainers also call at `gold_eval_steps` and at the end of a run). Held-out prompts: the built-in task's test split.
Default SFT model: the prepared built-in task's. `--backend auto` samples with vLLM on GPU and with transformers
on CPU, where a vLLM engine's 20-50 s start-up dwarfs sampling a few hundred prompts from a tiny model.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

COLUMNS = ("gold_win_rate", "gold_reward", "reference_gold_reward", "kl", "sft_perplexity", "completion_tokens_mean")


def _backend(kind: str, model_path: str, seed: int):
    import torch

    if kind == "auto":
        kind = "vllm" if torch.cuda.is_available() else "transformers"
    if kind == "transformers":
        return None  # evaluate_policy's in-process sampler over the loaded model
    from async_rlhf.generation.engine import load_backend

    return load_backend("vllm", model_path, device="cuda" if torch.cuda.is_available() else "cpu", seed=seed,
                        dtype="float32")


def evaluate_checkpoints(paths: list[str], sft_model_path: str | None, num_prompts: int, seed: int = 0,
                         backend: str = "auto") -> list[dict]:
    from async_rlhf.data.builtin_task import make_splits
    from async_rlhf.tasks.evaluation import gold_evaluation

    for path in paths:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise SystemExit(f"--model_name_or_path: {path} is not a saved model (no config.json)")
    if sft_model_path is None:
        from async_rlhf.tasks.build_builtin import prepare_builtin

        sft_model_path = prepare_builtin(seed=seed)["sft_model"]
    test = make_splits(seed, sizes={"train": 0, "validation": 0, "test": num_prompts})["test"]
    evaluate = gold_evaluation(sft_model_path, None, test, num_prompts, seed=seed,
                               backend_for=lambda path: _backend(backend, path, seed))
    return [{"model": path, **evaluate(path)} for path in paths]


def format_table(results: list[dict]) -> str:
    def cell(v):
        return "nan" if isinstance(v, float) and math.isnan(v) else f"{v:.3f}"

    lines = ["| model | " + " | ".join(COLUMNS) + " |", "|" + "---|" * (len(COLUMNS) + 1)]
    lines += ["| " + r["model"] + " | " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in results]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", nargs="+", required=True, help="saved policy directories")
    parser.add_argument("--sft_model_path", default=None, help="SFT model for KL (default: the built-in task's)")
    parser.add_argument("--num_prompts", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="task seed: which test prompts")
    parser.add_argument("--backend", choices=("auto", "vllm", "transformers"), default="auto")
    parser.add_argument("--output_file", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    results = evaluate_checkpoints(args.model_name_or_path, args.sft_model_path, args.num_prompts, args.seed,
                                   args.backend)
    print(format_table(results))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
