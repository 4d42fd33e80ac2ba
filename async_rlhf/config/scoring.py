"""How samples are scored: reward models and functions, their weights, failures, and where scoring runs
(`scoring/`).

Mixed into `config/base.AsyncRLConfig` under flat names, as TRL's are; types, ranges and relations are checked in
`config/checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ScoringFields:
    """Plain fields with defaults, collected by the config class's dataclass machinery."""

    reward_model_path: str | None = field(default=None, metadata={"help": "Path of a reward model (TRL field)."})
    reward_weights: list[float] | None = field(
        default=None, metadata={"help": "Weights of the reward functions (default: all 1)."}
    )
    missing_eos_penalty: float | None = field(
        default=None, metadata={"help": "Subtracted from the score of completions that end without EOS."}
    )
    reward_failure: str = field(
        default="raise",
        metadata={"help": "A reward that raises or is None/NaN/inf: 'raise' (fail naming prompt and function) or "
                  "'skip' (drop the sample and count it)."},
    )
    score_while_generating: bool | None = field(
        default=None,
        metadata={"help": "Learner rank 0 scores each part of a batch (a prompt group when streaming) with the reward "
                  "functions as soon as it arrives, while the rest is still being generated (RLHFuse's inter-stage "
                  "fusion); False: every rank scores its share of the batch inside the training step. None (auto): "
                  "on, except under DeepSpeed, where a partitioned reward model needs every rank for each forward "
                  "(True there is refused)."},
    )
    reward_shared_prefix: bool = field(
        default=False,
        metadata={"help": "Run the tokens that the n completions of a prompt share once through a reward model "
                  "(a causal LM with a sequence-classification head) and reuse its key/value cache for the rest "
                  "(scoring/reward_prefix.py; equal within float tolerance for rotary-position models, such as Llama)."},
    )
