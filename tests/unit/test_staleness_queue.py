import threading
import time

import pytest

from async_rlhf.pipeline.prompt_stream import PromptStream
from async_rlhf.pipeline.staleness_queue import StalenessQueue
from async_rlhf.errors import StageTimeout
from async_rlhf.types import Completion, RolloutBatch


def batch(batch_id, version):
    c = Completion([1, 2], [-0.1, -0.2], "stop")
    return RolloutBatch(batch_id, 0, version, [0], [[5]], [[c, c]], 0.01)


def test_admission_is_the_staleness_bound():
    q = StalenessQueue(max_staleness=1)
    assert q.admissible(0, 0) and q.admissible(1, 0) and not q.admissible(2, 0)
    q0 = StalenessQueue(max_staleness=0)
    assert q0.admissible(3, 3) and not q0.admissible(4, 3)


def test_get_returns_batches_by_id_whatever_the_arrival_order():
    q = StalenessQueue(max_staleness=2)
    q.put(batch(1, 0))
    q.put(batch(0, 0))
    assert q.get(0, learner_version=0, timeout=1).batch_id == 0
    assert q.get(1, learner_version=1, timeout=1).batch_id == 1
    assert dict(q.staleness_counts) == {0: 1, 1: 1}


def test_too_stale_batches_are_dropped_and_counted():
    q = StalenessQueue(max_staleness=1)
    q.put(batch(5, 3))  # trained at version 5, generated at 3: staleness 2 > 1
    assert q.get(5, learner_version=5, timeout=1) is None
    assert q.dropped == 1 and sum(q.staleness_counts.values()) == 0


def test_get_waits_for_a_producer_thread():
    q = StalenessQueue(max_staleness=1)
    threading.Timer(0.2, q.put, args=(batch(0, 0),)).start()
    assert q.get(0, learner_version=0, timeout=5).batch_id == 0


def test_get_times_out_naming_the_stage():
    q = StalenessQueue(max_staleness=1)
    t0 = time.monotonic()
    with pytest.raises(StageTimeout, match="rollout queue: batch 3 did not arrive"):
        q.get(3, learner_version=3, timeout=0.3)
    assert time.monotonic() - t0 < 2


def test_poll_errors_propagate():
    q = StalenessQueue(max_staleness=1)

    def poll():
        raise RuntimeError("generator 0 died")

    with pytest.raises(RuntimeError, match="generator 0 died"):
        q.get(0, learner_version=0, timeout=5, poll=poll)


def test_prompt_stream_covers_each_epoch_once_and_is_deterministic():
    s = PromptStream(num_prompts=10, prompts_per_step=3, seed=1)
    epoch0 = [i for step in range(3) for i in s.prompts_for_step(step)]
    assert len(set(epoch0)) == 9  # 3 full steps, the incomplete block of 1 is dropped
    again = PromptStream(10, 3, 1)
    assert [again.prompts_for_step(s_) for s_ in range(6)] == [s.prompts_for_step(s_) for s_ in range(6)]
    assert s.prompts_for_step(3) != s.prompts_for_step(0)  # a new permutation per epoch


def test_prompt_stream_rejects_too_few_prompts():
    with pytest.raises(ValueError, match="fewer than one step needs"):
        PromptStream(2, 4, 0)
