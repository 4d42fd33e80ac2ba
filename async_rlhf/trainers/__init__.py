"""TRL-style trainer classes built on the asynchronous pipeline."""

from async_rlhf.trainers.online_dpo import AsyncOnlineDPOTrainer

__all__ = ["AsyncOnlineDPOTrainer"]
