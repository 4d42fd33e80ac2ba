"""Checking a finished run from its own per-step records, not from its summary's counters.

The summary's staleness histogram only counts the batches the queue let through, so `max(histogram) <= bound`
holds by construction and cannot catch a batch trained beyond the bound. `trained_batches.jsonl` (written by the
trainer at every step: the step, the policy version of its batch, and each sample's oldest and newest token
version) can.
"""

from __future__ import annotations

import collections
import json
import os


def check_staleness_records(output_dir, steps: int, max_staleness: int, summary: dict | None = None,
                            dropped: int | None = 0) -> list[int]:
    """Assert that steps 0..steps-1 each trained exactly once, on a batch from policy version `step - k` with
    0 <= k <= max_staleness. With `summary` (run_summary.json), also that it agrees with the records (same step
    count, same histogram) and, unless `dropped` is None, that it dropped exactly `dropped` batches.
    Returns the staleness of each step's batch, in step order."""
    with open(os.path.join(output_dir, "trained_batches.jsonl")) as f:
        records = [json.loads(line) for line in f]
    trained = [r["step"] for r in records]
    assert sorted(trained) == list(range(steps)), f"steps trained (each must appear once): {trained}"
    staleness = [r["step"] - r["policy_version"] for r in sorted(records, key=lambda r: r["step"])]
    bad = {step: k for step, k in enumerate(staleness) if not 0 <= k <= max_staleness}
    assert not bad, f"steps trained outside staleness 0..{max_staleness} (step: steps behind): {bad}"
    for r in records:  # every sample, by its oldest and newest token (several versions with in-flight loads)
        for group in r["sample_versions"]:
            for oldest, newest in group:
                assert r["policy_version"] <= oldest <= newest <= r["step"], (r["step"], r["policy_version"], group)
    if summary is not None:
        assert summary["steps"] == steps
        assert summary["max_staleness"] == max_staleness
        histogram = {int(k): v for k, v in summary["staleness_histogram"].items()}
        assert histogram == dict(collections.Counter(staleness)), (histogram, staleness)
        if dropped is not None:
            assert summary["dropped"] == dropped, f"dropped {summary['dropped']} batch(es), expected {dropped}"
    return staleness


class RunsOnDemand(dict):
    """Runs keyed by their settings, each made by `make(key)` the first time a test asks for it (a module fixture
    returns one, so tests in the slow tier start no run in the default tier)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def __missing__(self, key):
        self[key] = self.make(key)
        return self[key]
