"""Request-level sampling on one vLLM engine: groups go in whenever they arrive, each comes back when it finishes.

`StreamEngine` drives the in-process `vllm.LLMEngine` of a `VLLMBackend` step by step (`add_request`, `step`), so
the engine is never drained between batches: prompts of the next admitted batch start while the tail of the previous
one decodes (continuous batching across batch boundaries), and every request (one prompt group, or a few) is
answered the moment its last sample ends. `generation/engine/worker.py` owns the loop that feeds it; this class only
keeps the book of which engine request belongs to which `GenerationRequest`.

Versions. The engine labels every output token with the weight version it had when the token was sampled
(`finish_weight_update(weight_version=str(v))`, see `vllm_backend.py`; vLLM returns them as `weight_versions` spans).
A `Completion` keeps them as `version_starts` ([version, first token] pairs) and a `RolloutBatch`'s
`policy_version` is the oldest version of any token in it, so the staleness bound applies to the oldest token.
When weights load only while the engine is empty (`weight_load="drain"`, the default) every sample has one version.

Hand-over (`tail_migration`, `handoffs=True`). vLLM reports a sample's tokens only when it finishes, and an aborted
request reports nothing, so an engine that may hand requests over asks for every step's new tokens instead
(`RequestOutputKind.DELTA`) and keeps each running sample's tokens, log-probs and versions itself: a token reported by
a step was sampled in that step, by the weights loaded then (weights load only between steps, `serve_loops.py`); when
a sample finishes, those labels are checked against vLLM's own spans. `handoff` aborts a request and returns it with
each sample as it stands (`GenerationRequest.prefixes`); `submit` of such a request continues every unfinished sample
from its prefix (prompt + tokens so far as the new prompt, the rest of its budget, a seed of its own) and, when it
ends, joins the two: tokens, behaviour log-probs and versions, each token keeping the version that sampled it.

Seeds are those of `VLLMBackend.generate` (prompt p of a request: `seed + p*n + i`, its i-th sample `seed + p*n + i`):
a group gets the same samples whether it is sampled alone, in a chunk, or in a whole batch (a continued sample: the
same up to the hand-over).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from async_rlhf.generation.engine.vllm_backend import VLLMBackend, completion_from_vllm, sampling_params
from async_rlhf.types import Completion, GenerationRequest, RolloutBatch

CONTINUATION_SEED_STRIDE = 1_000_003  # a continued sample's seed: its own seed + this x the tokens it already has


@dataclass
class _Sample:
    """A running sample's tokens so far (hand-over engines only)."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the version loaded when it was sampled


@dataclass
class _Open:
    request: GenerationRequest
    t0: float
    version: int  # loaded when it was submitted: the version of a sample without tokens
    groups: dict = field(default_factory=dict)  # prompt index -> {sample index -> finished Completion}
    running: dict = field(default_factory=dict)  # (prompt, sample) -> _Sample (hand-over engines only)
    engine_ids: set = field(default_factory=set)  # its vLLM requests not finished yet


class StreamEngine:
    """One `GenerationRequest` in, one `RolloutBatch` out when all of its prompts are done. Not thread-safe."""

    def __init__(self, backend: VLLMBackend, generator_id: int, handoffs: bool = False):
        self.backend = backend
        self.engine = backend.llm.llm_engine
        self.generator_id = generator_id
        self.handoffs = handoffs
        self._open: dict[str, _Open] = {}  # request key -> its state
        self._engine_ids: dict[str, tuple[str, int, int | None]] = {}  # vLLM id -> (key, prompt, sample or None)
        self.busy_seconds = 0.0  # time spent in engine steps

    @staticmethod
    def key(request) -> str:
        return f"{request.batch_id}.{request.chunk}"

    def submit(self, request: GenerationRequest, version: int) -> None:
        from vllm.inputs import TokensPrompt

        key = self.key(request)
        if key in self._open:
            raise ValueError(f"generator {self.generator_id}: request {key} is already being sampled")
        state = self._open[key] = _Open(request, time.perf_counter(), version)
        n = request.settings.n
        for p, ids in enumerate(request.prompt_token_ids):
            budget = request.max_new_tokens[p] if request.max_new_tokens else request.settings.max_new_tokens
            state.groups[p] = {}
            if not request.prefixes:  # the group from scratch: one engine request for its n samples
                self._add(state, f"{key}.{p}", (key, p, None), TokensPrompt(prompt_token_ids=list(ids)),
                          sampling_params(request.settings, p, final_only=True, budget=budget, delta=self.handoffs))
                continue
            for i, prefix in enumerate(request.prefixes[p]):
                if prefix.finish_reason:  # it had ended before the hand-over
                    state.groups[p][i] = prefix
                    continue
                seed = request.settings.seed
                if seed is not None:
                    seed += p * n + i + CONTINUATION_SEED_STRIDE * len(prefix.token_ids)
                self._add(state, f"{key}.{p}.{i}", (key, p, i),
                          TokensPrompt(prompt_token_ids=list(ids) + prefix.token_ids),
                          sampling_params(request.settings, p, budget=budget - len(prefix.token_ids),
                                          delta=self.handoffs, n=1, seed=seed))
        if all(len(g) == n for g in state.groups.values()):  # every sample had ended: nothing to run
            raise ValueError(f"generator {self.generator_id}: request {key} was handed over with nothing to sample")

    def _add(self, state: _Open, engine_id: str, where: tuple, prompt, params) -> None:
        self._engine_ids[engine_id] = where
        state.engine_ids.add(engine_id)
        self.engine.add_request(engine_id, prompt, params)

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
            if out.request_id not in self._engine_ids:  # handed over (aborted) since it was scheduled
                continue
            key, p, fixed = self._engine_ids[out.request_id]
            state = self._open[key]
            for c in out.outputs:
                i = c.index if fixed is None else fixed
                if self.handoffs:
                    self._note_tokens(state, (p, i), c, version)
                if c.finish_reason is not None:
                    state.groups[p][i] = self._finished(state, p, i, c)
            if out.finished:
                del self._engine_ids[out.request_id]
                state.engine_ids.discard(out.request_id)
            n = state.request.settings.n
            if not state.engine_ids and all(len(g) == n for g in state.groups.values()):
                del self._open[key]
                done.append(self._rollouts(state))
        return done

    def _note_tokens(self, state: _Open, where: tuple, output, version: int) -> None:
        sample = state.running.setdefault(where, _Sample())
        new = list(output.token_ids)
        sample.token_ids += new
        sample.logprobs += [step[tok].logprob for step, tok in zip(output.logprobs, new, strict=True)]
        sample.versions += [version] * len(new)

    def _finished(self, state: _Open, p: int, i: int, output) -> Completion:
        if not self.handoffs:
            return completion_from_vllm(output)
        sample = state.running.pop((p, i))
        done = completion_from_vllm(dataclasses.replace(output, token_ids=sample.token_ids, logprobs=[]),
                                    logprobs=sample.logprobs)
        if done.version_starts != _starts(sample.versions):
            raise RuntimeError(f"generator {self.generator_id}: vLLM's weight versions {done.version_starts} differ "
                               f"from the versions this engine noted step by step {_starts(sample.versions)}")
        prefixes = state.request.prefixes
        return joined(prefixes[p][i], done) if prefixes else done

    def handoff(self, batch_id: int, chunk: int) -> tuple[GenerationRequest, int] | None:
        """Abort request (`batch_id`, `chunk`) and return it with every sample as it stands (`prefixes`), and the
        tokens sampled here; None if it is not running here (it ended already)."""
        state = self._open.pop(f"{batch_id}.{chunk}", None)
        if state is None:
            return None
        if not self.handoffs:
            raise RuntimeError(f"generator {self.generator_id}: a hand-over needs an engine started with handoffs")
        self.engine.abort_request(sorted(state.engine_ids))
        for engine_id in state.engine_ids:
            del self._engine_ids[engine_id]
        r, tokens = state.request, 0
        prefixes = []
        for p in range(len(r.prompt_ids)):
            row = []
            for i in range(r.settings.n):
                if i in state.groups[p]:
                    row.append(state.groups[p][i])
                    continue
                s = state.running.get((p, i), _Sample())
                tokens += len(s.token_ids)
                now = Completion(s.token_ids, s.logprobs, "", _starts(s.versions))
                row.append(joined(r.prefixes[p][i], now) if r.prefixes else now)
            prefixes.append(row)
        return dataclasses.replace(r, prefixes=prefixes), tokens

    def _rollouts(self, state: _Open) -> RolloutBatch:
        r = state.request
        groups = [[state.groups[p][i] for i in range(r.settings.n)] for p in range(len(r.prompt_ids))]
        oldest = min(c.oldest_version(state.version) for g in groups for c in g)
        return RolloutBatch(batch_id=r.batch_id, generator_id=self.generator_id, policy_version=oldest,
                            prompt_ids=r.prompt_ids, prompt_token_ids=r.prompt_token_ids, completions=groups,
                            seconds=time.perf_counter() - state.t0, chunk=r.chunk, num_chunks=r.num_chunks)


def _starts(versions: list[int]) -> list[list[int]]:
    """Per-token versions -> [[version, first token], ...]."""
    return [[v, t] for t, v in enumerate(versions) if t == 0 or versions[t - 1] != v]


def joined(prefix: Completion, rest: Completion) -> Completion:
    """A sample's tokens up to a hand-over (`prefix`) followed by those sampled after it (`rest`): each token keeps its
    behaviour log-prob and the version that sampled it; the finish reason is `rest`'s."""
    shift = len(prefix.token_ids)
    starts = [list(s) for s in prefix.version_starts]
    for v, t in rest.version_starts:
        if not starts or starts[-1][0] != v:
            starts.append([v, t + shift])
    return Completion(prefix.token_ids + rest.token_ids, prefix.logprobs + rest.logprobs, rest.finish_reason, starts)
