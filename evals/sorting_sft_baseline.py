"""The sorting task's SFT policies evaluated as the staleness studies evaluate a trained one (512 held-out prompts,
sampled at temperature 1, gold reward), so each study's "gain over the SFT policy" has a record of its own.

    python evals/sorting_sft_baseline.py --sizes default small \
        --output_file evals/results/sorting_policy_size/sft_baseline.json

Builds a size's SFT policy first if it is not cached (`tasks/build_sorting.py`; the large one takes about 22 minutes
on an idle 2-core CPU). Prints {size: metrics} and writes it, keeping the entries of other sizes an existing
`--output_file` holds (so a size can be added later: `--sizes large --output_file` the same file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

EVAL_PROMPTS = 512  # the studies' `eval_prompts`


def evaluate_sft(size: str, num_prompts: int = EVAL_PROMPTS) -> dict:
    from async_rlhf.data import sorting_task
    from async_rlhf.tasks.build_sorting import prepare_sorting
    from async_rlhf.tasks.evaluation import gold_evaluation

    paths = prepare_sorting(size)
    split = sorting_task.make_splits(seed=0, sizes={"validation": 0, "test": num_prompts})["test"]
    evaluate = gold_evaluation(paths["sft_model"], paths["tokenizer"], split, num_prompts,
                               max_new_tokens=sorting_task.MAX_NEW_TOKENS, reward_fn=sorting_task.gold_reward,
                               temperature=1.0)  # as `tasks/setup.py::_sorting_task` evaluates a trained policy
    return {k: v for k, v in evaluate(paths["sft_model"]).items() if isinstance(v, (int, float))}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["default"], help="policy sizes: small, default, large")
    parser.add_argument("--num_prompts", type=int, default=EVAL_PROMPTS)
    parser.add_argument("--output_file", default=None, help="JSON file for the results")
    args = parser.parse_args(argv)
    results = {size: evaluate_sft(size, args.num_prompts) for size in args.sizes}
    print(json.dumps(results, indent=1))
    if args.output_file:
        kept = {}
        if os.path.exists(args.output_file):
            with open(args.output_file) as f:
                kept = json.load(f)
        with open(args.output_file, "w") as f:
            json.dump({**kept, **results}, f, indent=1)
            f.write("\n")
    return results


if __name__ == "__main__":
    main()
