"""Request-level sampling on one vLLM engine: groups go in whenever they arrive, each comes back when it finishes.

`StreamEngine` drives the in-process `vllm.LLMEngine` of a `VLLMBackend` step by step (`add_request`, `step`), so
the engine is never drained between batches: prompts of the next admitted batch start while the tail of the previous
one decodes (continuous batching across batch boundaries), and every request (one prompt group, or a few) is
answered the moment its last sample ends. `generation/engine/serve_loops.py` owns the loop that feeds it; this class
only keeps the book of which engine request belongs to which `GenerationRequest`.

Versions. The engine labels every output token with the weight version it had when the token was sampled
(`finish_weight_update(weight_version=str(v))`, see `vllm_backend.py`; vLLM returns them as `weight_versions` spans).
A `Completion` keeps them as `version_starts` ([version, first token] pairs) and a `RolloutBatch`'s
`policy_version` is the oldest version of any token in it, so the staleness bound applies to the oldest token.
When weights load only while the engine is empty (`weight_load="drain"`, the default) every sample has one version.

Extension points, each a method with the core's behaviour as its default, for an engine that serves an optional
schedule (a subclass named by `GeneratorSpec.stream_engine`; today `experimental/tail_migration/engine.py` and
`experimental/continuous_batching/engine.py`):
`start_group` (how a prompt group enters the engine), `noted` (every step's output of a sample, before it is
checked for its end), `finished` (a finished sample's `Completion`), `handle` (an inbox message kind the serve loop
does not know: the answers to put in the outbox) and `output_delta` (ask vLLM for every step's new tokens rather than
the finished sample's); and, for an engine that drives another sampler than vLLM's, `make_backend` (the backend the
generator process builds: the core's `load_backend`), `begin` (the version of the weights before any update: vLLM
labels tokens with its engine's weight version) and `load_weights` (load an update between two steps: the backend's
`load_weights`, which in vLLM's case also recomputes running samples over their context). The serve loop uses of an
engine only `busy`, `busy_seconds`, `submit`, `step`, `handle`, `begin` and `load_weights`.

Seeds are those of `VLLMBackend.generate` (prompt p of a request: `seed + p*n + i`, its i-th sample `seed + p*n + i`):
a group gets the same samples whether it is sampled alone, in a chunk, or in a whole batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from async_rlhf.generation.engine.vllm_backend import VLLMBackend, completion_from_vllm, sampling_params
from async_rlhf.types import Completion, GenerationRequest, RolloutBatch


@dataclass
class OpenRequest:
    """A request being sampled: what it asked, and its samples as they finish."""

    request: GenerationRequest
    t0: float
    version: int  # loaded when it was submitted: the version of a sample without tokens
    groups: dict = field(default_factory=dict)  # prompt index -> {sample index -> finished Completion}
    engine_ids: set = field(default_factory=set)  # its vLLM requests not finished yet
    ext: dict = field(default_factory=dict)  # what an engine extension keeps with the request (nothing in the core)


class StreamEngine:
    """One `GenerationRequest` in, one `RolloutBatch` out when all of its prompts are done. Not thread-safe."""

    output_delta = False  # True: vLLM reports every step's new tokens of a sample (`noted` sees each step)

    def __init__(self, backend: VLLMBackend, generator_id: int):
        self.backend = backend
        self.engine = backend.llm.llm_engine
        self.generator_id = generator_id
        self.open: dict[str, OpenRequest] = {}  # request key -> its state
        self.engine_ids: dict[str, tuple[str, int, int | None]] = {}  # vLLM id -> (key, prompt, sample or None)
        self.busy_seconds = 0.0  # time spent in engine steps

    @staticmethod
    def key(request) -> str:
        return f"{request.batch_id}.{request.chunk}"

    def submit(self, request: GenerationRequest, version: int, ext: dict | None = None) -> None:
        """Start sampling `request` with weights `version`; `ext`: an extension's own state for it."""
        key = self.key(request)
        if key in self.open:
            raise ValueError(f"generator {self.generator_id}: request {key} is already being sampled")
        state = self.open[key] = OpenRequest(request, time.perf_counter(), version, ext=dict(ext or {}))
        for p, ids in enumerate(request.prompt_token_ids):
            state.groups[p] = {}
            budget = request.max_new_tokens[p] if request.max_new_tokens else request.settings.max_new_tokens
            self.start_group(state, key, p, list(ids), budget)
        if self._done(state):  # nothing left to run (an extension's request whose samples had all ended)
            raise ValueError(f"generator {self.generator_id}: request {key} has nothing to sample")

    # ---- extension points (the core's behaviour) -----------------------------------------------------------
    @classmethod
    def make_backend(cls, kind: str, model_path: str, device: str, seed: int, engine_kwargs: dict):
        """The backend a generator serving with this engine builds: `load_backend(kind, ...)` (vLLM's for the core)."""
        from async_rlhf.generation.engine import load_backend

        return load_backend(kind, model_path, device=device, seed=seed, **engine_kwargs)

    def begin(self, version: int) -> None:
        """Before any request: the weights loaded are `version`; vLLM labels each token with it until an update."""
        self.backend.llm.update_weight_version(str(version))

    def load_weights(self, update) -> None:
        """Load `update` between two steps (samples may be running with `weight_load='in_flight'`: vLLM's backend
        preempts them and recomputes their context with the new weights, `vllm_backend.py`)."""
        self.backend.load_weights(update)

    def start_group(self, state: OpenRequest, key: str, p: int, prompt_ids: list[int], budget: int) -> None:
        """Put prompt group `p` of a submitted request into the engine: one engine request for its n samples."""
        from vllm.inputs import TokensPrompt

        self.add(state, f"{key}.{p}", (key, p, None), TokensPrompt(prompt_token_ids=prompt_ids),
                 sampling_params(state.request.settings, p, final_only=True, budget=budget, delta=self.output_delta))

    def noted(self, state: OpenRequest, p: int, i: int, output, version: int) -> None:
        """A step's output of sample (`p`, `i`), sampled with weights `version` (nothing to do in the core)."""

    def finished(self, state: OpenRequest, p: int, i: int, output) -> Completion:
        """Sample (`p`, `i`) ended: its `Completion`."""
        return completion_from_vllm(output)

    def handle(self, msg, version: int) -> list:
        """An inbox message of a kind the serve loop does not know (`version`: the weights loaded now): the messages
        to answer with."""
        raise ValueError(f"generator {self.generator_id}: unknown message kind {msg.kind!r}")

    # ---- the engine ----------------------------------------------------------------------------------------
    def add(self, state: OpenRequest, engine_id: str, where: tuple, prompt, params) -> None:
        self.engine_ids[engine_id] = where
        state.engine_ids.add(engine_id)
        self.engine.add_request(engine_id, prompt, params)

    def drop(self, key: str) -> OpenRequest | None:
        """Abort request `key` in the engine and forget it; its state (None if it is not running here)."""
        state = self.open.pop(key, None)
        if state is None:
            return None
        self.engine.abort_request(sorted(state.engine_ids))
        for engine_id in state.engine_ids:
            del self.engine_ids[engine_id]
        return state

    @property
    def busy(self) -> bool:
        """Samples are being generated (the engine has unfinished requests)."""
        return self.engine.has_unfinished_requests()

    def step(self, version: int = 0) -> list[RolloutBatch]:
        """One engine step (`version`: the weights loaded for it); the requests it finished."""
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.busy_seconds += time.perf_counter() - t0
        done = []
        for out in outputs:
            if out.request_id not in self.engine_ids:  # aborted since it was scheduled
                continue
            key, p, fixed = self.engine_ids[out.request_id]
            state = self.open[key]
            for c in out.outputs:
                i = c.index if fixed is None else fixed
                self.noted(state, p, i, c, version)
                if c.finish_reason is not None:
                    state.groups[p][i] = self.finished(state, p, i, c)
            if out.finished:
                del self.engine_ids[out.request_id]
                state.engine_ids.discard(out.request_id)
            if self._done(state):
                del self.open[key]
                done.append(self._rollouts(state))
        return done

    @staticmethod
    def _done(state: OpenRequest) -> bool:
        n = state.request.settings.n
        return not state.engine_ids and all(len(g) == n for g in state.groups.values())

    def _rollouts(self, state: OpenRequest) -> RolloutBatch:
        r = state.request
        groups = [[state.groups[p][i] for i in range(r.settings.n)] for p in range(len(r.prompt_ids))]
        oldest = min(c.oldest_version(state.version) for g in groups for c in g)
        return RolloutBatch(batch_id=r.batch_id, generator_id=self.generator_id, policy_version=oldest,
                            prompt_ids=r.prompt_ids, prompt_token_ids=r.prompt_token_ids, completions=groups,
                            seconds=time.perf_counter() - state.t0, chunk=r.chunk, num_chunks=r.num_chunks)
