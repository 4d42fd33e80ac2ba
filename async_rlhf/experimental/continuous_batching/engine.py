"""The streaming engine over transformers' continuous batching: `ContinuousBatchingEngine`, the `StreamEngine` a
generator serves with when `continuous_batching` is on (`GeneratorSpec.stream_engine`, chosen in
`experimental/schedules.py`; it builds its own backend, `backend.py`, through the `make_backend` extension point).

Each sample of a `GenerationRequest` is one sequence of the manager, added with `streaming=True`, so every decode
step reports each running sample's tokens so far; the serve loop (`generation/engine/serve_loops.serve_stream`)
calls `step`, which collects what the decode loop reported and answers each request the moment its last sample
ends, whatever else runs.

Versions and weight loads (`load_weights`, called by the serve loop between its steps). Tokens are labelled with the
version loaded when the serve loop collected them; that is the version that sampled them, because a load parks the
decode loop first (`backend.paused`), collects every token it had sampled (all sampled by the old weights, labelled
so), copies the new weights in, and only then lets the loop run again. With `weight_load='in_flight'` samples are
running at that moment: their keys and values in the paged cache were computed by the old weights, so each is
cancelled and started again as a new sequence, its prompt followed by its tokens so far, with what is left of its
budget: the new weights compute its whole context, and its next tokens are sampled from the new policy exactly, as
vLLM's backend recomputes a running request (`version_starts` then marks where the new version begins). The
cancelled sequence may still take the loop's next step (transformers applies cancellations at the step after): its
output is ignored. With `weight_load='drain'` the serve loop loads only when nothing runs, so each sample has one
version.

Seeds: see `backend.py` (one seed per generator process, no per-request seed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from async_rlhf.experimental.continuous_batching.backend import ContinuousBatchingBackend
from async_rlhf.generation.engine.stream_engine import OpenRequest, StreamEngine
from async_rlhf.types import GenerationRequest, RolloutBatch, WeightUpdate

STEP_WAIT = 0.05  # seconds `step` waits for the decode loop's next report before the serve loop reads its inbox again


@dataclass
class Sample:
    """One sample being generated: where it belongs, and its tokens so far with their versions."""

    key: str  # its request's key (`StreamEngine.key`)
    p: int  # prompt index in the request
    i: int  # sample index in its group
    prompt: list[int]
    budget: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    starts: list[list[int]] = field(default_factory=list)  # [[version, first token], ...]
    rid: str = ""  # the manager's sequence for it now
    base: int = 0  # tokens it had when that sequence started (a restart continues after them)
    restarts: int = 0


class ContinuousBatchingEngine(StreamEngine):
    """`StreamEngine`'s face over a `ContinuousBatchingBackend`. Not thread-safe (the serve loop's thread)."""

    def __init__(self, backend: ContinuousBatchingBackend, generator_id: int):  # not vLLM's: no super().__init__
        self.backend = backend
        self.engine = None
        self.generator_id = generator_id
        self.open: dict[str, OpenRequest] = {}
        self.engine_ids: dict[str, Sample] = {}  # the manager's sequence id -> the sample it generates
        self.busy_seconds = 0.0  # wall time with samples running
        self.version = 0
        self.answered: list[RolloutBatch] = []  # finished requests not yet returned by `step`
        self._since: float | None = None

    @classmethod
    def make_backend(cls, kind: str, model_path: str, device: str, seed: int, engine_kwargs: dict):
        if kind != "transformers":
            raise ValueError(f"continuous batching is transformers' engine; generator_backend is {kind!r}")
        return ContinuousBatchingBackend(model_path, device=device, seed=seed, **engine_kwargs)

    def begin(self, version: int) -> None:
        self.version = version

    @property
    def busy(self) -> bool:
        return bool(self.engine_ids) or bool(self.answered)

    def submit(self, request: GenerationRequest, version: int, ext: dict | None = None) -> None:
        if self._since is None:
            self._since = time.perf_counter()
        super().submit(request, version, ext)

    def start_group(self, state: OpenRequest, key: str, p: int, prompt_ids: list[int], budget: int) -> None:
        self.backend.use(state.request.settings)
        for i in range(state.request.settings.n):
            self._start(Sample(key, p, i, prompt_ids, budget), state)

    def _start(self, sample: Sample, state: OpenRequest) -> None:
        sample.rid = f"{sample.key}.{sample.p}.{sample.i}.{sample.restarts}"
        sample.base = len(sample.tokens)
        self.engine_ids[sample.rid] = sample
        state.engine_ids.add(sample.rid)
        self.backend.add(sample.rid, sample.prompt + sample.tokens, sample.budget - sample.base)

    def step(self, version: int = 0) -> list[RolloutBatch]:
        """Collect what the decode loop reported (waiting up to STEP_WAIT s); the requests now finished."""
        if self.engine_ids:
            self._collect(self.backend.results(wait=STEP_WAIT))
        now = time.perf_counter()
        if self._since is not None:
            self.busy_seconds += now - self._since
        self._since = now if self.engine_ids else None
        done, self.answered = self.answered, []
        return done

    def _collect(self, outputs: list) -> None:
        for out in outputs:
            sample = self.engine_ids.get(out.request_id)
            if sample is None:  # cancelled: restarted after a load, or dropped
                continue
            seen = len(sample.tokens) - sample.base
            new, logprobs = out.generated_tokens[seen:], out.logprobs[seen:]
            if len(new) != len(logprobs):
                raise RuntimeError(f"continuous batching reported {len(logprobs)} log-probs for {len(new)} tokens")
            if new:
                if not sample.starts or sample.starts[-1][0] != self.version:
                    sample.starts.append([self.version, len(sample.tokens)])
                sample.tokens += new
                sample.logprobs += logprobs
            if out.is_finished():
                self._finish(sample)

    def _finish(self, sample: Sample) -> None:
        del self.engine_ids[sample.rid]
        state = self.open[sample.key]
        state.engine_ids.discard(sample.rid)
        state.groups[sample.p][sample.i] = self.backend.completion(sample.tokens, sample.logprobs, sample.starts)
        if self._done(state):
            del self.open[sample.key]
            self.answered.append(self._rollouts(state))

    def load_weights(self, update: WeightUpdate) -> None:
        """Load `update` between two decode steps; running samples continue on it from their context, recomputed
        (module docstring)."""
        with self.backend.paused():
            if self.engine_ids:
                self._collect(self.backend.results(wait=0))  # every token of the old weights, labelled so
            self.backend.swap_weights(update)
            self.version = update.version
            for sample in list(self.engine_ids.values()):
                self.backend.cancel(sample.rid)
                del self.engine_ids[sample.rid]
                state = self.open[sample.key]
                state.engine_ids.discard(sample.rid)
                sample.restarts += 1
                self._start(sample, state)

    def drop(self, key: str) -> OpenRequest | None:
        state = self.open.pop(key, None)
        if state is None:
            return None
        for rid in sorted(state.engine_ids):
            self.backend.cancel(rid)
            del self.engine_ids[rid]
        return state
