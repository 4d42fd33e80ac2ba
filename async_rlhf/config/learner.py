"""How the learner runs its models: loading, dropout, how forwards are split and shared, attention kernels, and
what a non-finite step does (`learner/`).

Mixed into `config/base.AsyncRLConfig` under flat names, as TRL's are; types, ranges and relations are checked in
`config/checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LearnerFields:
    """Plain fields with defaults, collected by the config class's dataclass machinery."""

    max_nonfinite_steps: int = field(
        default=3,
        metadata={"help": "Optimizer steps in a row whose loss or gradient norm is NaN/inf that are skipped (the "
                  "weights are left as they were; counted in learner/nonfinite_steps) before the run fails and "
                  "saves a checkpoint; 0 fails on the first. Under DeepSpeed the engine steps inside backward, "
                  "before the gradient norm is known: such steps are counted and stop the run, but only fp16's "
                  "loss scaler skips their update."},
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout in the policy and reference."})
    reference_shared_prefix: bool = field(
        default=False,
        metadata={"help": "Run each prompt once through the frozen reference model and reuse its key/value cache for "
                  "the prompt's completions (RLHFless's shared prefix; equal to the unshared forward within float "
                  "tolerance, see benchmarks/shared_prefix.py for the time saved)."},
    )
    split_forwards: bool | None = field(
        default=None,
        metadata={"help": "Run each model once per length bucket, and the reference (`reference_shared_prefix`) and "
                  "online DPO's policy once per prompt, instead of once on every row padded to the longest. None "
                  "(default): on CPU learners (the built-in task's step 1.55x faster on 2 cores), not on GPUs (on an "
                  "H100 the split step of a 203M-parameter policy took 1.93x the padded one's time at 2,560 padded "
                  "tokens a step, where kernel launches bound it, and 0.89x-1.12x of it from 15,744 to 34,560; "
                  "docs/performance.md). True/False: always/never. Never under DeepSpeed (one forward per "
                  "backward)."},
    )
    cudnn_attention: bool = field(
        default=False,
        metadata={"help": "Let CUDA learners' scaled-dot-product attention use cuDNN's kernel. Off: cuDNN plans anew "
                  "for every new sequence shape, and RL batches change shape every step (on an H100, 18-21 ms of CPU "
                  "per attention call: most of the built-in task's learner step; docs/performance.md)."},
    )
    model_init_kwargs: dict | str | None = field(default=None, metadata={"help": "kwargs for from_pretrained (a dict, "
                                                                            "or JSON text)."})
