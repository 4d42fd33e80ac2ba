"""The messages of tail migration, between learner rank 0's pool and its local generator processes only (they are
never written as JSON: a continued request's samples ride a multiprocessing queue)."""

from __future__ import annotations

from dataclasses import dataclass

from async_rlhf.types import Completion, GenerationRequest


@dataclass(frozen=True)
class TailHandoff:
    """Learner -> generator: stop sampling request (`batch_id`, `chunk`) and send it back as it stands (`Migrated`),
    to be continued on another generator. Ignored if the request already ended."""

    batch_id: int
    chunk: int
    kind = "handoff"


@dataclass(frozen=True)
class ContinuedRequest:
    """Learner -> generator: `request`, moved here mid-sample; `prefixes[p][i]` is sample i of prompt p as it stood
    on the generator that gave it back (`finish_reason` "" while unfinished; its tokens' versions in
    `version_starts`), continued here from where it stopped."""

    request: GenerationRequest
    prefixes: list[list[Completion]]  # [P][n]
    kind = "continue"

    @property
    def batch_id(self) -> int:
        return self.request.batch_id

    @property
    def chunk(self) -> int:
        return self.request.chunk


@dataclass(frozen=True)
class Migrated:
    """Generator -> learner: the answer to a `TailHandoff`: the request with its samples so far."""

    generator_id: int
    request: ContinuedRequest
    tokens: int  # sampled on that generator so far, over all its samples (what the next one does not redo)
    kind = "migrated"
