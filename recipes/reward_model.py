"""The proxy reward model of the built-in task, trained like the paper's: on SFT samples labelled by the gold reward.

    python recipes/reward_model.py --sft_model_path outputs/sft --output_dir outputs/reward_model
    python recipes/reward_model.py --output_dir outputs/rm      # SFT model: the prepared cache's (built if absent)

Samples two completions per prompt from the SFT policy, labels each pair with the gold reward, trains the SFT
model with a scalar head on the Bradley-Terry loss, saves it with its tokenizer, and reports its held-out pairwise
accuracy against the gold labels (`reward_model_metrics.json`).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # `python recipes/reward_model.py` from a checkout
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from async_rlhf.config.cli import parse_args, set_process_defaults
from async_rlhf.tasks.build_builtin import RewardModelSettings


@dataclass
class RewardModelOutput:
    output_dir: str = field(default="outputs/reward_model", metadata={"help": "Where the reward model is saved."})
    sft_model_path: str | None = field(default=None, metadata={"help": "SFT policy that samples the pairs and "
                                                                       "initialises the model (default: the "
                                                                       "prepared built-in task's)."})


def main(argv: list[str]) -> dict:
    out, settings = parse_args((RewardModelOutput, RewardModelSettings), argv)
    import torch
    from accelerate import Accelerator
    from transformers import AutoTokenizer

    from async_rlhf.tasks.build_builtin import prepare_builtin, train_reward_model

    sft_path = out.sft_model_path or prepare_builtin(seed=settings.seed)["sft_model"]
    if not os.path.isfile(os.path.join(sft_path, "config.json")):
        raise SystemExit(f"--sft_model_path: {sft_path} has no config.json (run recipes/sft.py first)")
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = AutoTokenizer.from_pretrained(sft_path)
    model, metrics = train_reward_model(settings, sft_path, tokenizer, accelerator)
    if not accelerator.is_main_process:
        return {}
    model.save_pretrained(out.output_dir)
    tokenizer.save_pretrained(out.output_dir)
    with open(os.path.join(out.output_dir, "reward_model_metrics.json"), "w") as f:
        json.dump(metrics, f, indent=2)
    print(f"reward model saved to {out.output_dir}: held-out pairwise accuracy {metrics['eval_accuracy']:.3f} "
          f"(at init {metrics['eval_accuracy_at_init']:.3f}) on {metrics['eval_pairs']} gold-labelled pairs")
    return metrics


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    set_process_defaults()
    main(sys.argv[1:])
