"""The generator interface: one small protocol that every sampling engine implements.

A backend lives inside a generator process (see `generation/engine/worker.py`) and is never shared between
threads. It samples completions for token-id prompts and swaps its weights when the learner publishes a
new policy. vLLM is the default (`generation/engine/vllm_backend.py`); transformers' `generate` is the fallback
for machines without vLLM (`generation/engine/hf_backend.py`).
"""

from __future__ import annotations

from typing import Protocol

from async_rlhf.types import Completion, SamplingSettings, WeightUpdate


class GeneratorBackend(Protocol):
    name: str

    def generate(self, prompt_token_ids: list[list[int]], settings: SamplingSettings,
                 max_new_tokens: list[int] | None = None) -> list[list[Completion]]:
        """Sample `settings.n` completions per prompt, each at most `max_new_tokens[p]` tokens long (default
        `settings.max_new_tokens`). Returns [P][n] completions with behaviour log-probs."""

    def load_weights(self, update: WeightUpdate) -> None:
        """Replace the policy's weights with those described by `update` (all parameters, same names as the
        learner's `state_dict`). Returns once the next `generate` call samples from the new weights."""

    def join_weight_group(self, info) -> None:
        """Join learner rank 0's weight broadcast group (`weight_sync.broadcast.GroupInfo`), needed before a
        "broadcast" update. Blocks until the group has formed."""

    def close(self) -> None:
        """Free the engine. Idempotent."""
