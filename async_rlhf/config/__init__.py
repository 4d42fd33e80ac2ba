"""Configuration: `base.py` (`AsyncRLConfig`: transformers' `TrainingArguments` plus the asynchronous fields),
`algorithms.py` (each learner's own fields, TRL's names), `checks.py` (field checks and the one table of option
combinations that are refused), `trl_fields.py` (TRL fields and what they become here), `cli.py` (flags and YAML)."""

from async_rlhf.config.base import AsyncRLConfig
from async_rlhf.errors import ConfigError

__all__ = ["AsyncRLConfig", "ConfigError"]
