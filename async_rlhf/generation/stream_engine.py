"""Request-level sampling on one vLLM engine: groups go in whenever they arrive, each comes back when it finishes.

`StreamEngine` drives the in-process `vllm.LLMEngine` of a `VLLMBackend` step by step (`add_request`, `step`), so
the engine is never drained between batches: prompts of the next admitted batch start while the tail of the previous
one decodes (continuous batching across batch boundaries), and every request (one prompt group, or a few) is
answered the moment its last sample ends. `generation/worker.py` owns the loop that feeds it; this class only
keeps the book of which engine request belongs to which `GenerationRequest`.

Versions. The engine labels every output token with the weight version it had when the token was sampled
(`finish_weight_update(weight_version=str(v))`, see `vllm_backend.py`; vLLM returns them as `weight_versions` spans).
A `Completion` keeps them as `version_starts` ([version, first token] pairs) and a `RolloutBatch`'s
`policy_version` is the oldest version of any token in it, so the staleness bound applies to the oldest token.
When weights load only while the engine is empty (`weight_load="drain"`, the default) every sample has one version.

Seeds are those of `VLLMBackend.generate` (prompt p of a request: `seed + p*n`, its i-th sample `seed + p*n + i`):
a group gets the same samples whether it is sampled alone, in a chunk, or in a whole batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from async_rlhf.generation.vllm_backend import VLLMBackend, completion_from_vllm, sampling_params
from async_rlhf.types import GenerationRequest, RolloutBatch


@dataclass
class _Open:
    request: GenerationRequest
    t0: float
    version: int  # loaded when it was submitted: the version of a sample without tokens
    groups: dict = field(default_factory=dict)  # prompt index -> list[Completion]


class StreamEngine:
    """One `GenerationRequest` in, one `RolloutBatch` out when all of its prompts are done. Not thread-safe."""

    def __init__(self, backend: VLLMBackend, generator_id: int):
        self.backend = backend
        self.engine = backend.llm.llm_engine
        self.generator_id = generator_id
        self._open: dict[str, _Open] = {}  # request key -> its state
        self.busy_seconds = 0.0  # time spent in engine steps

    @staticmethod
    def key(request: GenerationRequest) -> str:
        return f"{request.batch_id}.{request.chunk}"

    def submit(self, request: GenerationRequest, version: int) -> None:
        from vllm.inputs import TokensPrompt

        key = self.key(request)
        if key in self._open:
            raise ValueError(f"generator {self.generator_id}: request {key} is already being sampled")
        self._open[key] = _Open(request, time.perf_counter(), version)
        for p, ids in enumerate(request.prompt_token_ids):
            params = sampling_params(request.settings, p, final_only=True,
                                     budget=request.max_new_tokens[p] if request.max_new_tokens else None)
            self.engine.add_request(f"{key}.{p}", TokensPrompt(prompt_token_ids=list(ids)), params)

    @property
    def busy(self) -> bool:
        """Samples are being generated (the engine has unfinished requests)."""
        return self.engine.has_unfinished_requests()

    def step(self) -> list[RolloutBatch]:
        """One engine step; the requests it finished."""
        t0 = time.perf_counter()
        outputs = self.engine.step()
        self.busy_seconds += time.perf_counter() - t0
        done = []
        for out in outputs:
            if not out.finished:
                continue
            key, p = out.request_id.rsplit(".", 1)
            state = self._open[key]
            state.groups[int(p)] = [completion_from_vllm(c) for c in sorted(out.outputs, key=lambda c: c.index)]
            if len(state.groups) == len(state.request.prompt_ids):
                del self._open[key]
                done.append(self._rollouts(state))
        return done

    def _rollouts(self, state: _Open) -> RolloutBatch:
        r = state.request
        groups = [state.groups[p] for p in range(len(r.prompt_ids))]
        oldest = min(c.oldest_version(state.version) for g in groups for c in g)
        return RolloutBatch(batch_id=r.batch_id, generator_id=self.generator_id, policy_version=oldest,
                            prompt_ids=r.prompt_ids, prompt_token_ids=r.prompt_token_ids, completions=groups,
                            seconds=time.perf_counter() - state.t0, chunk=r.chunk, num_chunks=r.num_chunks)
