"""Partial rollouts (APRIL, arXiv 2509.18521): over-provision prompt groups, close a step as soon as enough of them
have finished, and carry the unfinished ones into later steps. Lives on learner rank 0: `PartialBatches` is the
batch schedule (`pipeline/batch_forming.py`) that routes dispatch, arriving groups and `batch_for_step` here when
`partial_rollouts > 0`.

Groups. The prompt stream is read group by group: group (b, j) is prompt j of `PromptStream.prompts_for_step(b)`,
sampled with that pair's seeds, exactly as when batch b is streamed whole. Groups are sent in stream order while
fewer than `(queued_version + S - step + 1) x prompts_per_step + partial_rollouts` are open (sent, not
yet trained): the batches that admission allows today, plus `partial_rollouts` groups more. A group keeps running in
its generator across steps; with `weight_load="in_flight"` (required) every token keeps the version that sampled it,
and a group's `policy_version` is its oldest token's.

The staleness rule (`staleness_bound`). With S = max_staleness and S_old its cap on the oldest token (S_old = S under
"oldest"; max_oldest_staleness under "newest"), a finished group may be trained at step b when every sample's newest
token has version >= b - S and every token has version >= b - S_old. Under "oldest" the second implies the first: the
rule is the familiar "oldest token >= b - S". A group's *deadline* is the last step that may train it,
min(newest + S, oldest + S_old). Admission keeps the S horizon under both rules: a group that ends soon after it is
sent (most do) has its newest token near the queued weights q and must be trained by about q + S; sending S_old
steps' worth would only send groups to be dropped (measured: 15 of 32 dropped on a test run). The second cap
decides how long a group that keeps sampling stays trainable, and when a pinned one falls due.

Closing step b: it trains `prompts_per_step` finished groups within the rule, the earliest deadline first (then
stream order; under "oldest", the oldest version first). It waits only for enough such groups, and for a regenerated
group that is due (below); never for an unfinished first attempt. The unfinished groups left open are carried
(`carried`).

Guarantees:
* **Staleness bound.** No group outside the rule is trained at step b. A finished group that could only be trained
  past its deadline is dropped (`dropped`) and regenerated with the newest weights and a seed of its own
  (`attempt`); it is then *pinned*: the step at which its oldest token reaches the bound (`sent_version + S_old`)
  waits for it, so a prompt whose samples are always long is trained at its second attempt instead
  of being dropped for ever. Pinned groups due at one step beyond `prompts_per_step` are dropped again (counted).
* **Exactly once.** Every group of the stream up to the run's last step is trained by exactly one step (none twice,
  none skipped); `RolloutBatch.group_tags` names, for each prompt of a step's batch, its (batch, index) (`origin`), which is what
  `trained_batches.jsonl` records (`groups`, with each group's version span, `group_versions`).
* **Checkpoints** (`state`/`restore`): the open groups, the next group to send and the counters; finished but
  untrained groups are saved with their samples (the checkpoint's pending rollouts) and restored as they were
  (then staleness-checked like any other); unfinished ones are regenerated from their prompts after the resume,
  with the checkpoint's weights. So a resumed run trains exactly the groups the stopped one had not trained.
* **Timeouts.** `take` waits at most `timeout` seconds and raises `StageTimeout` naming the step and the groups.

Threads: `arrived` runs on the reader (or scoring) thread, everything else on the main thread; one condition guards
the state.

Experimental because it has not paid where measured: 1.04x-1.35x of batch-level but 0.78x-1.43x of streaming on
2 CPU cores under load, and on the default run the loop at 0.95x with a lower gold win-rate (0.578 against 0.618);
no GPU measurement (it needs vLLM; docs/performance.md, Verdicts).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

from async_rlhf.errors import StageTimeout
from async_rlhf.pipeline.batch_forming import PipelineAccess
from async_rlhf.types import RolloutBatch

ORIGIN = "origin"  # the `RolloutBatch.group_tags` key of a group's [batch, index] in the prompt stream


def origins(batch: RolloutBatch) -> list[list[int]]:
    """[P] [batch, index] in the prompt stream of each group of a batch this schedule formed ([] for another's)."""
    return [tag[ORIGIN] for tag in batch.group_tags if ORIGIN in tag]


@dataclasses.dataclass
class _Group:
    sent_version: int  # queued weights when it was last sent: its oldest token's version is at least this
    attempt: int = 0  # 0: first; n: regenerated n times after arriving too stale (then pinned)
    carried: bool = False  # was still generating when an earlier step closed
    to_send: bool = True
    rollouts: RolloutBatch | None = None


def deadline(part: RolloutBatch, max_staleness: int, max_oldest_staleness: int) -> int:
    """The last step that may train `part` under the staleness rule (module docstring)."""
    return min(part.newest_version() + max_staleness, part.policy_version + max_oldest_staleness)


class PartialRollouts:
    def __init__(self, prompts_per_step: int, max_staleness: int, extra: int,
                 send: Callable[[int, list[int], int], None], max_oldest_staleness: int | None = None):
        """`send(batch, indices, attempt)` sends groups (batch, j) for j in `indices` to the generators.
        `max_oldest_staleness`: the cap on the oldest token under staleness_bound "newest"; None: "oldest" (S)."""
        if max_staleness < 1 or extra < 1:
            raise ValueError(f"partial rollouts need max_staleness >= 1 and extra >= 1, got {max_staleness}, {extra}")
        s_old = max_staleness if max_oldest_staleness is None else max_oldest_staleness
        if s_old < max_staleness:
            raise ValueError(f"max_oldest_staleness must be >= max_staleness, got {s_old} < {max_staleness}")
        self.P, self.S, self.S_old, self.extra, self.send = prompts_per_step, max_staleness, s_old, extra, send
        self.step = 0  # next step to train
        self.next_group = 0  # next group of the stream to send, as b * P + j
        self.open: dict[tuple[int, int], _Group] = {}
        self.dropped = 0  # groups that arrived too stale to train, regenerated
        self.dropped_tokens = 0  # their completion tokens (work thrown away)
        self.carried = 0  # trained groups that were still generating when an earlier step closed
        self.trained = 0
        self._cond = threading.Condition()

    # ---- main thread ---------------------------------------------------------------------------------------------
    def dispatch(self, queued_version: int, total_steps: int) -> None:
        """Send what is owed: dropped groups first (pinned), then new groups of the stream up to the capacity."""
        with self._cond:
            resend = sorted(k for k, g in self.open.items() if g.to_send)
            capacity = (queued_version + self.S - self.step + 1) * self.P + self.extra
            new = []
            while len(self.open) < capacity and self.next_group < total_steps * self.P:
                key = divmod(self.next_group, self.P)
                self.open[key] = _Group(queued_version)
                new.append(key)
                self.next_group += 1
            for key in resend + new:
                g = self.open[key]
                g.to_send, g.sent_version = False, queued_version
            attempts = [self.open[k].attempt for k in resend]
        for key, attempt in zip(resend, attempts):
            self.send(key[0], [key[1]], attempt)
        by_batch: dict[int, list[int]] = {}
        for b, j in new:
            by_batch.setdefault(b, []).append(j)
        for b, indices in by_batch.items():
            self.send(b, indices, 0)

    def take(self, step: int, timeout: float, poll: Callable[[], None], dispatch: Callable[[], None]) -> RolloutBatch:
        """Step `step`'s batch: `prompts_per_step` finished groups within the bound (see the module docstring).
        `poll` (liveness checks) and `dispatch` (sends what `_drop_stale` made owed) run about once a second."""
        deadline = time.monotonic() + timeout
        while True:
            with self._cond:
                self.step = step
                self._drop_stale(step)
                chosen = self._choose(step)
                if chosen is not None:
                    return self._close(step, chosen)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StageTimeout(self._timeout_message(step, timeout))
                self._cond.wait(min(1.0, left))
            dispatch()
            poll()

    def _drop_stale(self, step: int) -> None:
        for g in self.open.values():
            if g.rollouts is not None and deadline(g.rollouts, self.S, self.S_old) < step:
                self.dropped_tokens += g.rollouts.num_tokens
                g.rollouts, g.attempt, g.to_send = None, g.attempt + 1, True
                self.dropped += 1

    def _choose(self, step: int) -> list[tuple[int, int]] | None:
        ready = [k for k, g in self.open.items() if g.rollouts is not None]
        pinned_due = any(g.rollouts is None and not g.to_send and g.attempt and g.sent_version + self.S_old == step
                         for g in self.open.values())
        if len(ready) < self.P:
            return None
        if pinned_due and sum(1 for k in ready if self.open[k].attempt) < self.P:
            return None  # wait for the due pinned groups, unless finished pinned groups fill the step anyway
        ready.sort(key=lambda k: (deadline(self.open[k].rollouts, self.S, self.S_old), -self.open[k].attempt, k))
        return ready[:self.P]

    def _close(self, step: int, chosen: list[tuple[int, int]]) -> RolloutBatch:
        parts = [self.open.pop(k) for k in chosen]
        self.carried += sum(g.carried for g in parts)
        self.trained += len(parts)
        for g in self.open.values():
            if g.rollouts is None:
                g.carried = True
        self.step = step + 1
        return RolloutBatch.merged(step, [g.rollouts for g in parts], group_tags=[{ORIGIN: list(k)} for k in chosen])

    def _timeout_message(self, step: int, timeout: float) -> str:
        ready = sum(g.rollouts is not None for g in self.open.values())
        waiting = sorted(k for k, g in self.open.items() if g.rollouts is None)
        return (f"rollout queue: step {step} did not get {self.P} finished groups from the generators within "
                f"{timeout:.0f}s ({ready} finished; still generating: {waiting[:8]}"
                f"{' ...' if len(waiting) > 8 else ''}). A generator is stalled or too slow; raise rollout_timeout "
                "if generation is legitimately this slow.")

    # ---- reader thread ---------------------------------------------------------------------------------------------
    def arrived(self, part: RolloutBatch) -> None:
        """A group came back (one prompt: streaming sends one request per group)."""
        with self._cond:
            g = self.open.get((part.batch_id, part.chunk))
            if g is None or g.rollouts is not None or g.to_send:
                return  # not open (trained already, or a duplicate) or dropped and not re-sent yet: a stale answer
            g.rollouts = part
            self._cond.notify_all()

    # ---- checkpoints and metrics -----------------------------------------------------------------------------------
    def state(self) -> tuple[dict, list[RolloutBatch]]:
        """What a checkpoint saves: the bookkeeping (JSON) and the finished, untrained groups."""
        with self._cond:
            keys = sorted(self.open)
            return ({"next_group": self.next_group, "open": [[b, j, self.open[(b, j)].attempt] for b, j in keys],
                     "dropped": self.dropped, "carried": self.carried, "trained": self.trained,
                     "dropped_tokens": self.dropped_tokens},
                    [self.open[k].rollouts for k in keys if self.open[k].rollouts is not None])

    def restore(self, state: dict, finished: list[RolloutBatch], version: int) -> None:
        """From a checkpoint saved at `version`: finished groups as they were, unfinished ones to send again."""
        self.step = version
        self.next_group = int(state["next_group"])
        self.dropped, self.carried, self.trained, self.dropped_tokens = (
            int(state.get(k, 0)) for k in ("dropped", "carried", "trained", "dropped_tokens"))
        self.open = {(b, j): _Group(version, attempt=a) for b, j, a in state["open"]}
        for part in finished:
            g = self.open.get((part.batch_id, part.chunk))
            if g is None:
                raise ValueError(f"finished group {(part.batch_id, part.chunk)} is not among the open groups")
            g.rollouts, g.to_send = part, False

    def stats(self) -> dict[str, float]:
        with self._cond:
            finished = sum(g.rollouts is not None for g in self.open.values())
            return {"partial/open": float(len(self.open)), "partial/finished_waiting": float(finished),
                    "partial/carried": float(self.carried), "partial/dropped": float(self.dropped),
                    "partial/dropped_tokens": float(self.dropped_tokens),
                    "partial/carried_fraction": self.carried / self.trained if self.trained else 0.0}


def restore_partial(partial: PartialRollouts | None, setting: int, version: int, pending: list[RolloutBatch],
                    counters: dict) -> None:
    """Partial rollouts' state from a checkpoint saved at `version`; one saved with the other setting is refused."""
    from async_rlhf.errors import CheckpointError

    state = counters.get("partial")
    if version > 0 and (state is None) != (partial is None):
        raise CheckpointError(
            f"resume_from_checkpoint: the checkpoint was saved with partial_rollouts {'on' if state else 'off'}, "
            f"this run has partial_rollouts={setting}; resume with the setting it was saved with (rollouts in flight "
            "are kept differently)")
    if state is not None and partial is not None:
        try:
            partial.restore(state, pending, version)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"resume_from_checkpoint: partial rollouts' state is malformed: {exc}") from exc


class PartialBatches:
    """Partial rollouts as a batch schedule (`pipeline/batch_forming.py`): dispatch, arriving groups and each step's
    batch go to `PartialRollouts`; the pipeline (`PipelineAccess`) sends, checks liveness and counts staleness."""

    name = "partial_rollouts"
    per_micro_batch = False

    def __init__(self, access: PipelineAccess, prompts_per_step: int, max_staleness: int, setting: int,
                 max_oldest_staleness: int | None):
        self.p = access
        self.setting = setting
        self.max_oldest_staleness = max_oldest_staleness
        self.partial = PartialRollouts(prompts_per_step, max_staleness, setting, access.send, max_oldest_staleness)

    def restore(self, version: int, pending: list[RolloutBatch], counters: dict) -> None:
        restore_partial(self.partial, self.setting, version, pending, counters)

    def counters(self) -> dict:
        return {"partial": self.partial.state()[0]}

    def pending(self, step: int) -> list[RolloutBatch]:
        return self.partial.state()[1]  # finished, untrained groups

    def dispatch(self) -> None:
        self.partial.dispatch(self.p.queued_version(), self.p.total_steps())

    def take(self, step: int) -> RolloutBatch:
        self.dispatch()
        batch = self.partial.take(step, self.p.rollout_timeout, self.p.check, self.dispatch)
        self.p.queue.staleness_counts[step - batch.policy_version] += 1
        return batch

    def take_micro(self, step: int, micro: int, micro_batches: int, count: int) -> RolloutBatch:
        raise NotImplementedError("partial rollouts' batches are sliced by the pipeline (per_micro_batch is False)")

    def arrived(self, part: RolloutBatch) -> bool:
        self.partial.arrived(part)
        return True  # each group stands alone, waiting for a step to take it

    def stats(self) -> dict[str, float]:
        return self.partial.stats()

    def summary(self) -> dict:
        """For the run summary: groups carried across steps, and dropped for staleness; the staleness rule
        (`staleness_bound`: "oldest" bounds every token by max_staleness, "newest" the newest token by it and the
        oldest by max_oldest_staleness)."""
        newest = self.max_oldest_staleness is not None
        return {"partial_rollouts": {k.split("/")[1]: v for k, v in self.partial.stats().items()},
                "staleness_bound": "newest" if newest else "oldest", "max_oldest_staleness": self.max_oldest_staleness,
                **({"bound_rule": f"on the newest token, {self.max_oldest_staleness} on the oldest"} if newest else {})}

    def describe(self, batch: RolloutBatch) -> dict:
        """For the trained-batch record: each group's place in the prompt stream and its version span."""
        return {"groups": origins(batch), "group_versions": batch.group_versions()} if batch.group_tags else {}
