"""Micro-batches in arrival order (`arrival_order.ArrivalOrder`, `train_while_generating`), driven as the pipeline
drives it: parts arrive on another thread, the step takes micro-batches as groups arrive and the rest once its batch
is whole. The real generators and trainer: tests/integration/test_train_while_generating.py."""

from __future__ import annotations

import threading
import time

import pytest

from async_rlhf import AsyncGRPOConfig, AsyncOnlineDPOConfig
from async_rlhf.experimental.arrival_order import ArrivalOrder
from async_rlhf.errors import ConfigError
from async_rlhf.errors import StageTimeout
from async_rlhf.types import Completion, RolloutBatch


def part(batch, chunk, prompts, version, num_chunks):
    """A streamed part: one request's prompts, each with two completions whose tokens all have `version`."""
    c = Completion([1, 2], [-0.1, -0.2], "stop", [[version, 0]])
    return RolloutBatch(batch, 0, version, prompts, [[5]] * len(prompts), [[c, c] for _ in prompts], 0.01,
                        chunk=chunk, num_chunks=num_chunks, rewards=[[float(p), -float(p)] for p in prompts])


def whole(parts):
    return RolloutBatch.merged(parts[0].batch_id, sorted(parts, key=lambda p: p.chunk))


def test_micro_batches_take_groups_in_arrival_order_and_the_last_takes_the_rest():
    order = ArrivalOrder(max_staleness=1)
    parts = [part(3, c, [30 + c], 2, 6) for c in range(6)]
    for c in (4, 1, 5):  # the quickest three, not in prompt order
        order.add(parts[c])
    first = order.take(3, 2, timeout=1)
    assert first.prompt_ids == [34, 31] and first.rewards == [[34.0, -34.0], [31.0, -31.0]]
    assert first.batch_id == 3 and first.policy_version == 2
    second_waits = threading.Thread(target=lambda: (time.sleep(0.2), order.add(parts[0])))
    second_waits.start()
    second = order.take(3, 2, timeout=5)  # needs a fourth group: waits for it
    second_waits.join()
    assert second.prompt_ids == [35, 30]
    for c in (2, 3):
        order.add(parts[c])
    rest = order.rest(whole(parts))
    assert rest.prompt_ids == [32, 33]
    assert (order.early, order.early_groups) == (2, 4)  # both taken while the batch was still being generated
    assert not order.has(3)  # forgotten once the step took its last micro-batch


def test_a_micro_batch_waits_at_most_the_timeout_and_says_how_many_groups_came():
    order = ArrivalOrder(max_staleness=1)
    order.add(part(0, 0, [1], 0, 4))
    polls = []
    with pytest.raises(StageTimeout, match=r"step 0 waited 1.2 s for 2 of its prompt groups and 1 arrived"):
        order.take(0, 2, timeout=1.2, poll=lambda: polls.append(1))
    assert polls  # liveness checks ran while it waited


def test_a_poll_that_raises_ends_the_wait():
    order = ArrivalOrder(max_staleness=1)

    def dead():
        raise RuntimeError("generator 0 died")

    with pytest.raises(RuntimeError, match="generator 0 died"):
        order.take(0, 1, timeout=30, poll=dead)


def test_a_group_over_the_bound_is_never_trained_early():
    order = ArrivalOrder(max_staleness=1)
    order.add(part(5, 0, [1], 3, 2))  # version 3 for step 5: two steps behind, bound 1
    with pytest.raises(RuntimeError, match="over max_staleness 1"):
        order.take(5, 1, timeout=1)


def test_a_batch_that_comes_back_different_after_early_groups_is_refused():
    """Groups trained early can never be trained again: a batch regenerated after them is an error, not a step."""
    order = ArrivalOrder(max_staleness=1)
    parts = [part(2, c, [c], 1, 3) for c in range(3)]
    order.add(parts[0])
    order.take(2, 1, timeout=1)
    for p in parts[1:] + [parts[1]]:  # one group arrived twice
        order.add(p)
    with pytest.raises(RuntimeError, match="trained 1 of its groups early"):
        order.rest(whole(parts))


def test_select_keeps_rows_rewards_and_the_oldest_version_of_their_tokens():
    old = Completion([1], [-0.5], "stop", [[1, 0], [2, 1]])
    new = Completion([1], [-0.5], "stop", [[3, 0]])
    batch = RolloutBatch(7, -1, 1, [10, 11, 12], [[5], [6], [7]], [[old, old], [new, new], [new, old]], 0.1,
                         rewards=[[1.0, 2.0], [3.0, 4.0], [5.0, None]],
                         reward_components={"r": [[1.0, 2.0], [3.0, 4.0], [5.0, None]]})
    picked = batch.select([2, 1])
    assert picked.prompt_ids == [12, 11] and picked.prompt_token_ids == [[7], [6]]
    assert picked.rewards == [[5.0, None], [3.0, 4.0]] and picked.reward_components["r"] == picked.rewards
    assert picked.policy_version == 1  # row 2 holds a sample whose first token is version 1
    assert batch.select([1]).policy_version == 3


def test_a_micro_batch_taken_once_its_batch_is_whole_is_not_counted_early():
    order = ArrivalOrder(max_staleness=1)
    parts = [part(0, c, [c], 0, 2) for c in range(2)]
    for p in parts:
        order.add(p)
    order.take(0, 1, timeout=1)
    assert order.rest(whole(parts)).prompt_ids == [1]
    assert (order.early, order.early_groups) == (0, 0)


def test_forget_before_drops_what_steps_already_trained_left_behind():
    order = ArrivalOrder(max_staleness=1)
    order.add(part(1, 0, [1], 0, 2))
    order.add(part(4, 0, [1], 3, 2))
    order.forget_before(4)
    assert not order.has(1) and order.has(4)


@pytest.mark.parametrize("fields,message", [
    ({"gradient_accumulation_steps": 1, "per_device_train_batch_size": 8},
     r"needs gradient_accumulation_steps >= 2 \(got 1\).*per_device_train_batch_size 2 with gradient_accumulation_steps 4"),
    ({"gradient_accumulation_steps": 2, "partial_rollouts": 4, "generation_mode": "stream", "weight_load": "in_flight",
      "generator_backend": "vllm"}, "not with partial_rollouts=4"),
])
def test_config_refuses_what_it_cannot_do(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), train_while_generating=True, **fields)


def test_grpo_with_a_whole_step_denominator_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="not with loss_type='dapo'"):
        AsyncGRPOConfig(output_dir=str(tmp_path), train_while_generating=True, gradient_accumulation_steps=2)
    AsyncGRPOConfig(output_dir=str(tmp_path), train_while_generating=True, gradient_accumulation_steps=2,
                    loss_type="grpo")
