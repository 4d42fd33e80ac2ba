"""What the rollout pipeline checkpoints and reports: its counters (saved in `async_rlhf_pipeline.json` and restored on
resume) and its cumulative metrics (`queue/*`, `generator/*`, `sync/*`, `learner/*`, read by the trainer's logs and
the run summary). A mixin of `RolloutPipeline` (`pipeline/rollout_pipeline.py`), which owns the state it reads."""

from __future__ import annotations


class PipelineRecords:
    # ---- checkpoint state ------------------------------------------------------------------------------------
    def counters(self) -> dict:
        return {"staleness_counts": {str(k): v for k, v in self.queue.staleness_counts.items()},
                "dropped": self.queue.dropped, "regenerated": self.regenerated,
                "sync_bytes": self.sync_bytes, "syncs": self.syncs,
                **({"partial": self.partial.state()[0]} if self.partial is not None else {})}

    def restore_counters(self, c: dict) -> None:
        self.queue.staleness_counts.update({int(k): v for k, v in c.get("staleness_counts", {}).items()})
        self.queue.dropped += c.get("dropped", 0)
        self.regenerated += c.get("regenerated", 0)
        self.sync_bytes += c.get("sync_bytes", 0)
        self.syncs += c.get("syncs", 0)

    # ---- metrics -----------------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Cumulative pipeline metrics (meaningful on rank 0)."""
        q = self.queue
        trained = sum(q.staleness_counts.values())
        out = {
            "queue/staleness_mean": (sum(s * c for s, c in q.staleness_counts.items()) / trained) if trained else 0.0,
            "queue/staleness_max": float(max(q.staleness_counts, default=0)),
            "queue/dropped": float(q.dropped),
            "queue/regenerated": float(self.regenerated),
            "queue/depth": float(len(q)),
            "generator/tokens_per_s": self.gen_tokens / self.gen_seconds if self.gen_seconds else 0.0,
            "learner/wait_seconds": self.timers["wait"],
            "sync/count": float(self.syncs),
            **self.imbalance.stats(),
            "sync/bytes": float(self.sync_bytes),
            "sync/gather_seconds": self.timers["sync_gather"],
            "sync/transfer_seconds": self.timers["sync_transfer"],
        }
        if self.pool is not None:
            self.load_seconds = sum(self.pool.acks.load_seconds)
            out["generator/version_loaded"] = float(self.pool.acks.min_loaded_version())
        if self.transport is not None:
            out.update(self.transport.stats())
        out["sync/load_seconds"] = self.load_seconds
        if self.pool is not None:
            self.busy_seconds = sum(self.pool.acks.busy_seconds.values())
        out["generator/busy_seconds"] = self.busy_seconds
        if self.tail is not None:
            out.update(self.tail.stats())
        if self.partial is not None:
            out.update(self.partial.stats())
        if self.scoring is not None:
            out.update(self.scoring.stats())
        if self.arrivals is not None:
            out["learner/early_micro_batches"] = float(self.arrivals.early)
        if self.spec:
            out.update(speculation_metrics(self.spec))
        return out


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
