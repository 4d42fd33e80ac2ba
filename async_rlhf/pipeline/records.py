"""What the rollout pipeline records: its counters (saved in `async_rlhf_pipeline.json` and restored on resume), its
cumulative metrics (`queue/*`, `generator/*`, `sync/*`, `learner/*`, read by the trainer's logs and the run summary)
and the per-batch stage times the planner's feedback reads (`plan/feedback.py`).

One `PipelineRecords` per pipeline, on learner rank 0 (other ranks hold one that stays empty). Threads: the main
thread writes the step and sync counters; the reader thread (or scoring thread) calls `part_arrived` and
`batch_assembled`, which take the record's own lock."""

from __future__ import annotations

import collections
import threading
import time

from async_rlhf.pipeline.assignment import ImbalanceTally
from async_rlhf.types import RolloutBatch


class PipelineRecords:
    def __init__(self):
        self.timers: collections.defaultdict[str, float] = collections.defaultdict(float)  # wait, sync_gather, ...
        self.regenerated = 0  # batches regenerated because they arrived too stale
        self.sync_bytes = 0
        self.syncs = 0
        self.gen_tokens = 0  # tokens of trained batches, and the generator seconds they took
        self.gen_seconds = 0.0
        self.start_seconds = 0.0  # generators spawned -> ready
        self.start_wait_seconds = 0.0  # of which the learner waited in `start`
        self.load_seconds = 0.0  # generator-side weight loading, summed (kept after the pool closes)
        self.busy_seconds = 0.0  # generator-side sampling time, summed (kept after close; local generators only)
        self.loaded_versions: dict[int, int] = {}  # generator id -> last acknowledged version (kept after close)
        self.pending_versions: dict[int, list[int]] = {}  # generator id -> versions it never acknowledged (after close)
        self.restarts = 0
        self.places: dict[int, dict] = {}  # generator id -> {device, where, weights} (kept after close)
        self.spec: dict[int, dict] = {}  # generator id -> its latest cumulative speculation counters
        self.schedule_summary: dict = {}  # the schedules' sections of the run summary (`summary()`), kept after close
        self.imbalance = ImbalanceTally()  # generator/imbalance: max/mean tokens per generator
        self.length_counts: collections.Counter = collections.Counter()  # completion tokens: samples
        self.latency = [0.0, 0.0, 0]  # summed dispatch -> queued and last part arrived -> queued seconds; batches
        self._dispatched_at: dict[int, float] = {}
        self._arrived_at: dict[int, float] = {}
        self._lock = threading.Lock()

    # ---- events ------------------------------------------------------------------------------------------------
    def dispatched(self, batch_id: int) -> None:
        with self._lock:
            self._dispatched_at.setdefault(batch_id, time.perf_counter())

    def part_arrived(self, part: RolloutBatch) -> None:
        with self._lock:
            self.length_counts.update(len(c.token_ids) for group in part.completions for c in group)
            self._arrived_at[part.batch_id] = time.perf_counter()
            if part.spec:
                self.spec[part.generator_id] = part.spec

    def batch_assembled(self, batch_id: int, ordered: list[RolloutBatch], generators: int) -> None:
        """Every part of batch `batch_id` is in (`ordered`: its parts in chunk order)."""
        with self._lock:
            now, sent, arrived = (time.perf_counter(), self._dispatched_at.pop(batch_id, None),
                                  self._arrived_at.pop(batch_id, None))
            if sent is not None and arrived is not None:
                self.latency = [self.latency[0] + now - sent, self.latency[1] + now - arrived, self.latency[2] + 1]
            if len(ordered) > 1 and generators > 1:
                self.imbalance.add(ordered, generators)

    def batch_taken(self, batch: RolloutBatch, wait_seconds: float) -> None:
        self.timers["wait"] += wait_seconds
        self.gen_tokens += batch.num_tokens
        self.gen_seconds += batch.seconds

    def pool_state(self, pool) -> None:
        """What the run summary keeps of the pool's account (called while it runs and once it has closed)."""
        self.load_seconds = sum(pool.acks.load_seconds)
        self.busy_seconds = sum(pool.acks.busy_seconds.values())
        self.loaded_versions = dict(pool.acks.loaded_version)
        self.restarts = sum(pool.restarts.values())
        self.places = {g: dict(p) for g, p in pool.places.items()}

    # ---- checkpoint state --------------------------------------------------------------------------------------
    def counters(self, queue) -> dict:
        return {"staleness_counts": {str(k): v for k, v in queue.staleness_counts.items()},
                "dropped": queue.dropped, "regenerated": self.regenerated,
                "sync_bytes": self.sync_bytes, "syncs": self.syncs}

    def restore_counters(self, queue, c: dict) -> None:
        queue.staleness_counts.update({int(k): v for k, v in c.get("staleness_counts", {}).items()})
        queue.dropped += c.get("dropped", 0)
        self.regenerated += c.get("regenerated", 0)
        self.sync_bytes += c.get("sync_bytes", 0)
        self.syncs += c.get("syncs", 0)

    # ---- metrics -----------------------------------------------------------------------------------------------
    def stats(self, queue) -> dict[str, float]:
        """Cumulative pipeline metrics of these records and the staleness queue (meaningful on rank 0)."""
        trained = sum(queue.staleness_counts.values())
        return {
            "queue/staleness_mean": (sum(s * c for s, c in queue.staleness_counts.items()) / trained) if trained else 0.0,
            "queue/staleness_max": float(max(queue.staleness_counts, default=0)),
            "queue/dropped": float(queue.dropped),
            "queue/regenerated": float(self.regenerated),
            "queue/depth": float(len(queue)),
            "generator/tokens_per_s": self.gen_tokens / self.gen_seconds if self.gen_seconds else 0.0,
            "learner/wait_seconds": self.timers["wait"],
            "sync/count": float(self.syncs),
            **self.imbalance.stats(),
            "sync/bytes": float(self.sync_bytes),
            "sync/gather_seconds": self.timers["sync_gather"],
            "sync/transfer_seconds": self.timers["sync_transfer"],
            # what the learner is blocked for at one sync, on average (gather or partition copy + publish)
            "sync/blocked_seconds": (self.timers["sync_gather"] + self.timers["sync_transfer"]) / self.syncs
            if self.syncs else 0.0,
            "sync/load_seconds": self.load_seconds,
            "generator/busy_seconds": self.busy_seconds,
            **(speculation_metrics(self.spec) if self.spec else {}),
        }


def speculation_metrics(spec: dict[int, dict]) -> dict[str, float]:
    """`generator/spec_*` from each generator's cumulative counters (drafts: steps that proposed a draft; a draft's
    accepted length is its accepted tokens; wasted: proposed and rejected), summed and per generator."""
    out = {}
    for key, counters in [("", _summed(spec.values()))] + [(f"_{g}", c) for g, c in sorted(spec.items())]:
        drafts, proposed, accepted = counters["drafts"], counters["draft_tokens"], counters["accepted_tokens"]
        out[f"generator/spec_acceptance_rate{key}"] = accepted / proposed if proposed else 0.0
        out[f"generator/spec_mean_accepted_length{key}"] = accepted / drafts if drafts else 0.0
        out[f"generator/spec_drafted_tokens{key}"] = float(proposed)
        out[f"generator/spec_wasted_tokens{key}"] = float(proposed - accepted)
    return out


def _summed(counters) -> dict[str, int]:
    total = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    for c in counters:
        for k in total:
            total[k] += c.get(k, 0)
    return total
