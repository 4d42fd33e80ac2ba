"""Supervised fine-tuning of the built-in task's policy on its (noisy) demonstrations.

    python recipes/sft.py --output_dir outputs/sft                     # ~1-2 minutes on 2 CPU cores
    python recipes/sft.py --output_dir outputs/sft --num_layers 4

Builds the task tokenizer and a tiny Llama in code, trains it on the train split's demonstrations (loss on the
completion and EOS), saves model + tokenizer to `output_dir`, and prints its gold evaluation against the
reference summaries (`sft_eval.json`). `prepare_builtin()` runs the same steps for the recipes' default cache.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # `python recipes/sft.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_rlhf.config.cli import parse_args, set_process_defaults
from async_rlhf.tasks.build_builtin import SFTSettings


@dataclass
class SFTOutput:
    output_dir: str = field(default="outputs/sft", metadata={"help": "Where the model and tokenizer are saved."})
    eval_prompts: int = field(default=256, metadata={"help": "Held-out prompts for the gold evaluation (0: skip)."})


def main(argv: list[str]) -> dict:
    out, settings = parse_args((SFTOutput, SFTSettings), argv)
    from accelerate import Accelerator

    from async_rlhf.tasks.build_builtin import train_sft
    from async_rlhf.data.tokenizer import build_tokenizer
    from async_rlhf.tasks.evaluation import evaluate_policy

    accelerator = Accelerator(cpu=not __import__("torch").cuda.is_available())
    tokenizer = build_tokenizer()
    model = train_sft(settings, tokenizer, accelerator)
    if not accelerator.is_main_process:
        return {}
    model.save_pretrained(out.output_dir)
    tokenizer.save_pretrained(out.output_dir)
    results = {}
    if out.eval_prompts:
        results = evaluate_policy(model, None, num_prompts=out.eval_prompts, seed=settings.seed, tokenizer=tokenizer)
        with open(os.path.join(out.output_dir, "sft_eval.json"), "w") as f:
            json.dump(results, f, indent=2)
        print(f"SFT policy saved to {out.output_dir}: gold win-rate vs references {results['gold_win_rate']:.3f}, "
              f"gold reward {results['gold_reward']:.3f} (references {results['reference_gold_reward']:.3f})")
    return results


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    set_process_defaults()
    main(sys.argv[1:])
