"""What the learner processes hold besides the trainer loop: `logprobs.py` (per-token log-probabilities and
sequence terms), `frozen_models.py` (reference and reward models), `peft_policy.py` (LoRA policies),
`checkpointing.py` (what a checkpoint adds for an exact resume) and `nonfinite.py` (the non-finite step guard)."""
