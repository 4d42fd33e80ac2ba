"""Partial rollouts' book-keeping (`partial_rollouts.PartialRollouts`), driven the way the pipeline drives it: groups
go out through `send`, come back through `arrived` (from another thread where it matters), steps take batches.
The generators are replaced by the test answering the requests it recorded, with the versions it chooses; the real
generators are in tests/integration/test_partial_rollouts_run.py."""

from __future__ import annotations

import json
import threading

import pytest

from async_rlhf.errors import CheckpointError, ConfigError, StageTimeout
from async_rlhf.experimental.partial_rollouts import PartialRollouts, origins, restore_partial
from async_rlhf.types import Completion, RolloutBatch

P = 2  # prompts per step


class Book:
    """Records what the ledger sends: (batch, index) -> attempt of the latest send."""

    def __init__(self):
        self.sent: list[tuple[int, int, int]] = []

    def __call__(self, batch, indices, attempt):
        self.sent += [(batch, j, attempt) for j in indices]


def group(b, j, version):
    c = Completion([1, 2], [-0.1, -0.2], "stop", [[version, 0]])
    return RolloutBatch(b, 0, version, [b * P + j], [[5]], [[c, c]], 0.01, chunk=j, num_chunks=P)


def ledger(extra=2, staleness=1):
    book = Book()
    return PartialRollouts(P, staleness, extra, book), book


def noop():
    pass


def test_sends_admitted_batches_plus_the_extra_groups_in_stream_order():
    pr, book = ledger(extra=1)
    pr.dispatch(queued_version=0, total_steps=10)
    # (S + 1) x P = 4 groups that admission allows, plus 1
    assert book.sent == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0)]
    pr.dispatch(queued_version=0, total_steps=10)
    assert len(book.sent) == 5  # nothing more until a step is trained


def test_a_step_closes_on_the_first_finished_groups_and_carries_the_rest():
    pr, book = ledger(extra=1)
    pr.dispatch(0, 10)
    for b, j in [(1, 1), (2, 0)]:  # the two quickest, not batch 0's
        pr.arrived(group(b, j, 0))
    batch = pr.take(0, timeout=1, poll=noop, dispatch=noop)
    assert batch.batch_id == 0 and origins(batch) == [[1, 1], [2, 0]] and batch.prompt_ids == [3, 4]
    assert pr.open.keys() == {(0, 0), (0, 1), (1, 0)}  # still generating: carried into step 1
    pr.dispatch(queued_version=1, total_steps=10)
    assert book.sent[5:] == [(2, 1, 0), (3, 0, 0)]  # the capacity refilled: P groups
    for b, j in [(0, 0), (0, 1)]:
        pr.arrived(group(b, j, 0))
    batch = pr.take(1, timeout=1, poll=noop, dispatch=noop)
    assert origins(batch) == [[0, 0], [0, 1]] and batch.policy_version == 0
    assert pr.carried == 2 and pr.trained == 4


def test_a_group_too_stale_to_train_is_dropped_regenerated_pinned_and_waited_for():
    pr, book = ledger(extra=2)
    pr.dispatch(0, 10)  # 6 groups at version 0
    pr.arrived(group(0, 0, 0))
    pr.arrived(group(0, 1, 0))
    pr.take(0, 1, noop, noop)
    pr.dispatch(1, 10)
    for key in [(1, 0), (1, 1)]:
        pr.arrived(group(*key, 1 if key == (1, 1) else 0))
    pr.take(1, 1, noop, noop)
    pr.dispatch(2, 10)
    pr.arrived(group(2, 0, 0))  # version 0 at step 2: past max_staleness 1
    for key in [(3, 0), (3, 1)]:
        pr.arrived(group(*key, 2))
    batch = pr.take(2, 1, noop, noop)
    assert [2, 0] not in origins(batch) and pr.dropped == 1
    pr.dispatch(3, 10)
    assert (2, 0, 1) in book.sent  # regenerated: attempt 1, its own seeds
    assert pr.open[(2, 0)].sent_version == 3  # due at step 4 (3 + max_staleness)
    # step 3 does not wait for it (not due yet); step 4 does, even with other groups finished
    for key in [(2, 1), (4, 0), (4, 1), (5, 0)]:
        pr.arrived(group(*key, 3))
    assert [2, 0] not in origins(pr.take(3, 1, noop, noop))
    pr.dispatch(4, 10)
    with pytest.raises(StageTimeout, match="step 4"):
        pr.take(4, timeout=0.3, poll=noop, dispatch=noop)
    pr.arrived(group(2, 0, 3))
    assert [2, 0] in origins(pr.take(4, 1, noop, noop))


def test_every_group_is_trained_exactly_once_whatever_the_finishing_order():
    import random

    rng = random.Random(0)
    steps = 30
    pr, book = ledger(extra=3, staleness=2)
    version, answered, trained = 0, 0, []
    pr.dispatch(version, steps)
    for step in range(steps):
        while True:  # answer a random subset of what is in flight, with the newest version for late ones
            in_flight = [(b, j) for b, j in pr.open if pr.open[(b, j)].rollouts is None and not pr.open[(b, j)].to_send]
            for key in rng.sample(in_flight, k=min(len(in_flight), rng.randint(0, 3))):
                pr.arrived(group(*key, max(pr.open[key].sent_version, version - rng.randint(0, 3))))
                answered += 1
            try:
                batch = pr.take(step, timeout=0.05, poll=noop, dispatch=lambda: pr.dispatch(version, steps))
                break
            except StageTimeout:
                continue
        assert all(step - 2 <= v[0] for v in batch.group_versions())  # never past the bound
        trained += [tuple(o) for o in origins(batch)]
        version = step + 1
        pr.dispatch(version, steps)
    assert len(trained) == len(set(trained)) == steps * P
    assert set(trained) == {divmod(k, P) for k in range(steps * P)}  # none lost, none twice
    assert pr.dropped > 0  # the random versions did exercise the regeneration


def test_arrivals_from_another_thread_wake_the_step():
    pr, _ = ledger()
    pr.dispatch(0, 10)
    threading.Timer(0.2, lambda: [pr.arrived(group(0, j, 0)) for j in range(P)]).start()
    assert origins(pr.take(0, timeout=5, poll=noop, dispatch=noop)) == [[0, 0], [0, 1]]


def test_checkpoint_keeps_finished_groups_and_regenerates_unfinished_ones():
    pr, _ = ledger(extra=1)
    pr.dispatch(0, 10)
    for key in [(0, 0), (1, 0), (2, 0)]:
        pr.arrived(group(*key, 0))
    pr.take(0, 1, noop, noop)  # trains (0, 0), (1, 0); (2, 0) finished and waiting; (0, 1), (1, 1) generating
    state, finished = pr.state()
    state = json.loads(json.dumps(state))  # through JSON, as in a checkpoint
    finished = [RolloutBatch.from_dict(json.loads(json.dumps(b.to_dict()))) for b in finished]
    assert [(b.batch_id, b.chunk) for b in finished] == [(2, 0)]

    resumed, book = ledger(extra=1)
    restore_partial(resumed, 1, 1, finished, {"partial": state})
    resumed.dispatch(queued_version=1, total_steps=10)
    assert book.sent[:2] == [(0, 1, 0), (1, 1, 0)]  # the unfinished ones, from their prompts, with their seeds
    assert (2, 0) not in [(b, j) for b, j, _ in book.sent]  # the finished one is not generated again
    resumed.arrived(group(0, 1, 1))
    assert origins(resumed.take(1, 1, noop, noop)) == [[2, 0], [0, 1]]  # oldest version first
    with pytest.raises(CheckpointError, match="partial_rollouts"):
        restore_partial(None, 0, 1, finished, {"partial": state})
    with pytest.raises(CheckpointError, match="partial_rollouts"):
        restore_partial(ledger()[0], 2, 1, [], {"staleness_counts": {}})


@pytest.mark.parametrize("kw", [
    {"max_staleness": 0}, {"generation_mode": "batch"}, {"weight_load": "drain"},
    {"generator_backend": "transformers"}, {"partial_rollouts": -1},
])
def test_settings_partial_rollouts_cannot_work_with_are_refused(make_config, kw):
    fields = {"partial_rollouts": 4, "weight_load": "in_flight", **kw}
    with pytest.raises(ConfigError, match="partial_rollouts"):
        make_config(**fields)
    assert make_config(partial_rollouts=4, weight_load="in_flight").partial_rollouts == 4
