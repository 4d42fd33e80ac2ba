"""Data that crosses stages: prompts go out to generators, rollouts come back, weights go out again.

Everything here is a small dataclass of plain Python values (ints, floats, strings, lists) so that it can cross
a `multiprocessing` queue between our own processes. Tensors never ride these messages: weights travel
through shared memory or a torch.distributed group (see `weight_sync/`), and the messages only say where.

Versions: `policy_version` is the number of learner optimizer steps whose weights a generator had loaded when it
sampled. Version 0 is the initial policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingSettings:
    """How a generator samples; the same for every backend."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    n: int = 2  # completions per prompt
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]  # [T] generated tokens, EOS included when it was sampled
    logprobs: list[float]  # [T] behaviour log-prob of each sampled token under the generator's policy
    finish_reason: str  # "stop" (EOS or stop token) or "length" (hit max_new_tokens)


@dataclass(frozen=True)
class GenerationRequest:
    """Learner -> generator: sample `settings.n` completions for each prompt of one batch."""

    kind = "generate"
    batch_id: int  # which optimizer step will train on this batch (0-based)
    prompt_ids: list[int]  # [P] index of each prompt in the prompt stream
    prompt_token_ids: list[list[int]]  # [P][L_p]
    settings: SamplingSettings
    chunk: int = 0  # a batch is split across generators: this is part `chunk` of `num_chunks`
    num_chunks: int = 1


@dataclass(frozen=True)
class WeightUpdate:
    """Learner -> generator: load the policy at `version`.

    transport "shm": a safetensors file in RAM (/dev/shm) at `path`; "broadcast": tensors arrive over the
    torch.distributed group set up with the generator (`weight_sync/broadcast.py`), one per entry of `names`, in
    that order, each with the dtype and shape given here.
    """

    version: int
    transport: str  # "shm" | "broadcast"
    path: str = ""
    names: list[str] = field(default_factory=list)  # [K] state_dict names
    num_bytes: int = 0
    dtypes: list[str] = field(default_factory=list)  # [K] torch dtype names ("float32", ...); "broadcast" only
    shapes: list[list[int]] = field(default_factory=list)  # [K] tensor shapes; "broadcast" only
    kind = "weights"


@dataclass(frozen=True)
class Shutdown:
    """Learner -> generator: finish and exit."""

    kind = "shutdown"


@dataclass(frozen=True)
class RolloutBatch:
    """Generator -> learner: the completions for one GenerationRequest."""

    batch_id: int
    generator_id: int
    policy_version: int  # version of the weights that sampled every completion here
    prompt_ids: list[int]  # [P]
    prompt_token_ids: list[list[int]]  # [P][L_p]
    completions: list[list[Completion]]  # [P][n]
    seconds: float  # generation wall time
    chunk: int = 0
    num_chunks: int = 1
    kind = "rollouts"

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for group in self.completions for c in group)


@dataclass(frozen=True)
class WeightAck:
    """Generator -> learner: the generator now samples with `version`."""

    generator_id: int
    version: int
    seconds: float  # time to receive and load
    kind = "weights_loaded"


@dataclass(frozen=True)
class GeneratorReady:
    """Generator -> learner: engine started, initial weights loaded."""

    generator_id: int
    backend: str
    seconds: float
    kind = "ready"


@dataclass(frozen=True)
class GeneratorError:
    """Generator -> learner: the generator failed; `message` holds the exception and traceback."""

    generator_id: int
    message: str
    kind = "error"


@dataclass
class ScoredGroup:
    """One prompt with its n completions and their rewards, ready for a loss."""

    prompt_id: int
    prompt_token_ids: list[int]  # [L_p]
    completions: list[Completion]  # [n]
    rewards: list[float]  # [n] combined reward per completion (after penalties)
    policy_version: int  # version that sampled the completions
