"""The generator side of tail migration: a `StreamEngine` that can give a request back mid-sample and continue one
given back by another generator.

vLLM reports a sample's tokens only when it finishes, and an aborted request reports nothing, so this engine asks for
every step's new tokens instead (`output_delta`) and keeps each running sample's tokens, log-probs and versions
itself: a token reported by a step was sampled in that step, by the weights loaded then (weights load only between
steps, `serve_loops.py`); when a sample finishes, those labels are checked against vLLM's own spans. A `TailHandoff`
aborts its request and answers `Migrated` with each sample as it stands; a `ContinuedRequest` continues every
unfinished sample from its prefix (prompt + tokens so far as the new prompt, the rest of its budget, a seed of its
own) and, when it ends, joins the two: tokens, behaviour log-probs and versions, each token keeping the version that
sampled it. A continued sample is the same as the uncontinued one up to the hand-over.
"""

from __future__ import annotations

import dataclasses

from async_rlhf.experimental.tail_migration.messages import ContinuedRequest, Migrated
from async_rlhf.generation.engine.stream_engine import OpenRequest, StreamEngine
from async_rlhf.generation.engine.vllm_backend import completion_from_vllm, sampling_params
from async_rlhf.types import Completion

CONTINUATION_SEED_STRIDE = 1_000_003  # a continued sample's seed: its own seed + this x the tokens it already has


@dataclasses.dataclass
class _Sample:
    """A running sample's tokens so far."""

    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # per token: the version loaded when it was sampled


class HandoffEngine(StreamEngine):
    """`StreamEngine` with hand-overs (see the module docstring). Per request it keeps, in `OpenRequest.ext`,
    "running": (prompt, sample) -> `_Sample`, and for a continued request "prefixes": [P][n] `Completion`."""

    output_delta = True

    def handle(self, msg, version: int) -> list:
        if msg.kind == "continue":
            self.submit(msg.request, version, ext={"prefixes": msg.prefixes})
            return []
        if msg.kind == "handoff":
            moved = self.handoff(msg.batch_id, msg.chunk)
            return [] if moved is None else [Migrated(self.generator_id, *moved)]  # None: it ended first
        return super().handle(msg, version)

    def start_group(self, state: OpenRequest, key: str, p: int, prompt_ids: list[int], budget: int) -> None:
        prefixes = state.ext.get("prefixes")
        if not prefixes:
            return super().start_group(state, key, p, prompt_ids, budget)
        from vllm.inputs import TokensPrompt

        settings = state.request.settings
        for i, prefix in enumerate(prefixes[p]):
            if prefix.finish_reason:  # it had ended before the hand-over
                state.groups[p][i] = prefix
                continue
            seed = settings.seed
            if seed is not None:
                seed += p * settings.n + i + CONTINUATION_SEED_STRIDE * len(prefix.token_ids)
            self.add(state, f"{key}.{p}.{i}", (key, p, i), TokensPrompt(prompt_token_ids=prompt_ids + prefix.token_ids),
                     sampling_params(settings, p, budget=budget - len(prefix.token_ids), delta=True, n=1, seed=seed))

    def noted(self, state: OpenRequest, p: int, i: int, output, version: int) -> None:
        sample = state.ext.setdefault("running", {}).setdefault((p, i), _Sample())
        new = list(output.token_ids)
        sample.token_ids += new
        sample.logprobs += [step[tok].logprob for step, tok in zip(output.logprobs, new, strict=True)]
        sample.versions += [version] * len(new)

    def finished(self, state: OpenRequest, p: int, i: int, output) -> Completion:
        sample = state.ext["running"].pop((p, i))
        done = completion_from_vllm(dataclasses.replace(output, token_ids=sample.token_ids, logprobs=[]),
                                    logprobs=sample.logprobs)
        if done.version_starts != _starts(sample.versions):
            raise RuntimeError(f"generator {self.generator_id}: vLLM's weight versions {done.version_starts} differ "
                               f"from the versions this engine noted step by step {_starts(sample.versions)}")
        prefixes = state.ext.get("prefixes")
        return joined(prefixes[p][i], done) if prefixes else done

    def handoff(self, batch_id: int, chunk: int) -> tuple[ContinuedRequest, int] | None:
        """Abort request (`batch_id`, `chunk`) and return it with every sample as it stands, and the tokens sampled
        here; None if it is not running here (it ended already)."""
        state = self.drop(f"{batch_id}.{chunk}")
        if state is None:
            return None
        r, tokens, before = state.request, 0, state.ext.get("prefixes")
        running = state.ext.get("running", {})
        prefixes = []
        for p in range(len(r.prompt_ids)):
            row = []
            for i in range(r.settings.n):
                if i in state.groups[p]:
                    row.append(state.groups[p][i])
                    continue
                s = running.get((p, i), _Sample())
                tokens += len(s.token_ids)
                now = Completion(s.token_ids, s.logprobs, "", _starts(s.versions))
                row.append(joined(before[p][i], now) if before else now)
            prefixes.append(row)
        return ContinuedRequest(r, prefixes), tokens


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
