"""What is sampled: completions per prompt, lengths and the sampling distribution (TRL's names where TRL has them;
TRL's other generation fields: `config/trl_fields.py`).

Mixed into `config/base.AsyncRLConfig` under flat names, as TRL's are; types, ranges and relations are checked in
`config/checks.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingFields:
    """Plain fields with defaults, collected by the config class's dataclass machinery."""

    num_generations: int = field(default=2, metadata={"help": "Completions sampled per prompt (>= 2)."})
    max_new_tokens: int = field(default=64, metadata={"help": "Maximum tokens generated per completion."})
    max_length: int = field(default=512, metadata={"help": "Maximum prompt + completion tokens in the forward pass."})
    temperature: float = field(default=0.9, metadata={"help": "Sampling temperature."})
    top_p: float = field(default=1.0, metadata={"help": "Nucleus sampling mass in (0, 1]."})
    top_k: int = field(default=0, metadata={"help": "Top-k filter; 0 disables it."})
    min_p: float | None = field(default=None, metadata={"help": "Drop tokens less likely than min_p x the most likely "
                                                                 "one (after temperature); None or 0: off (TRL)."})
    repetition_penalty: float = field(default=1.0, metadata={"help": "Logits of tokens already in the prompt or "
                                      "completion become l/p if l > 0 else l*p; 1.0: off (TRL)."})

    @property
    def sampling_temperature(self) -> float:
        """The temperature the generators sample at and the losses' ratios use: `temperature`, or 0 (greedy) where
        TRL's `generation_kwargs` holds `do_sample=False` (`temperature` then keeps its value, as in TRL's
        `generation_config`)."""
        if (self.generation_kwargs or {}).get("do_sample") is False:
            return 0.0
        return self.temperature
