"""The staleness rule of `staleness_bound` ("oldest" / "newest", with `max_oldest_staleness`), as partial rollouts apply
it (`partial_rollouts.PartialRollouts`, `partial_rollouts.deadline`), and its configuration. Groups carry per-token
versions (`Completion.version_starts`) the way in-flight weight loads produce them; the real generators are in
tests/integration/test_partial_rollouts_run.py."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncGRPOConfig, AsyncOnlineDPOConfig, AsyncPPOConfig, AsyncRLOOConfig
from async_rlhf.errors import ConfigError
from async_rlhf.experimental.partial_rollouts import PartialRollouts, deadline, origins
from async_rlhf.types import Completion, RolloutBatch

P = 2  # prompts per step


def sample(*spans):
    """A 6-token completion whose tokens from `first` on were sampled by `version`, for each (version, first)."""
    return Completion([1] * 6, [-0.1] * 6, "stop", [list(s) for s in spans])


def group(b, j, *samples):
    """Group (b, j) holding `samples`; its policy_version is its oldest token's, as a generator reports it."""
    oldest = min(c.oldest_version(0) for c in samples)
    return RolloutBatch(b, 0, oldest, [b * P + j], [[5]], [list(samples)], 0.01, chunk=j, num_chunks=P)


class Book:
    def __init__(self):
        self.sent = []

    def __call__(self, batch, indices, attempt):
        self.sent += [(batch, j, attempt) for j in indices]


def noop():
    pass


def test_newest_version_is_the_least_fresh_samples_newest_token():
    # sample A: tokens 0-2 by version 0, 3-5 by version 2 (it kept generating); sample B ended on version 1
    g = group(0, 0, sample((0, 0), (2, 3)), sample((1, 0)))
    assert g.policy_version == 0  # oldest token: what "oldest" bounds
    assert g.newest_version() == 1  # min(2, 1): B's newest token is the binding one under "newest"
    assert g.sample_versions() == [[[0, 2], [1, 1]]]  # what trained_batches.jsonl records per sample


def test_deadline_under_each_rule():
    spanning = group(0, 0, sample((0, 0), (2, 3)))  # oldest 0, newest 2
    # "oldest" (S_old = S = 1): min(2 + 1, 0 + 1) = 1: the oldest token decides
    assert deadline(spanning, 1, 1) == 1
    # "newest", S = 1, S_old = 3: min(2 + 1, 0 + 3) = 3; S_old = 2: min(3, 2) = 2, the second cap binds
    assert deadline(spanning, 1, 3) == 3
    assert deadline(spanning, 1, 2) == 2
    early = group(0, 1, sample((0, 0)))  # ended on version 0: min(0 + 1, 0 + 3) = 1, however generous S_old is
    assert deadline(early, 1, 3) == 1


def test_admission_keeps_the_max_staleness_horizon_under_both_rules():
    # a group that ends soon after it is sent must train within S steps of its newest token whichever the rule:
    # (q + S - step + 1) x P + extra = (0 + 1 - 0 + 1) x 2 + 1 = 5 groups, not S_old's (0 + 3 + 1) x 2 + 1 = 9
    for cap in (None, 3):
        book = Book()
        PartialRollouts(P, 1, 1, book, max_oldest_staleness=cap).dispatch(queued_version=0, total_steps=20)
        assert len(book.sent) == 5, cap


def _two_steps(pr):
    """Steps 0 and 1 train batch 0's and batch 1's groups (version 0 and 1), leaving the rest open."""
    pr.dispatch(0, 20)
    pr.arrived(group(0, 0, sample((0, 0))))
    pr.arrived(group(0, 1, sample((0, 0))))
    pr.take(0, 1, noop, noop)
    pr.dispatch(1, 20)
    pr.arrived(group(1, 0, sample((1, 0))))
    pr.arrived(group(1, 1, sample((1, 0))))
    pr.take(1, 1, noop, noop)


def test_a_group_that_kept_sampling_on_fresh_weights_trains_under_newest_and_is_dropped_under_oldest():
    for cap, expect_dropped in ((None, 2), (3, 0)):
        pr = PartialRollouts(P, 1, 1, Book(), max_oldest_staleness=cap)
        _two_steps(pr)
        pr.dispatch(2, 20)
        # at step 2 two groups sent at version 0 finish: their oldest tokens are 2 steps behind, their newest fresh
        pr.arrived(group(2, 0, sample((0, 0), (2, 4))))
        pr.arrived(group(2, 1, sample((0, 0), (1, 2), (2, 5))))
        pr.arrived(group(3, 0, sample((2, 0))))
        pr.arrived(group(3, 1, sample((2, 0))))
        batch = pr.take(2, 1, noop, noop)
        assert pr.dropped == expect_dropped, cap
        if cap is None:  # "oldest": deadline 0 + 1 < 2, dropped and regenerated; batch 3's fresh groups train
            assert origins(batch) == [[3, 0], [3, 1]]
        else:  # "newest": deadline min(2 + 1, 0 + 3) = 3, trained first (earliest deadline), oldest token 2 behind
            assert origins(batch) == [[2, 0], [2, 1]] and batch.policy_version == 0 and batch.newest_version() == 2


def test_under_newest_a_sample_that_ended_early_and_a_too_old_token_are_still_dropped():
    pr = PartialRollouts(P, 1, 1, Book(), max_oldest_staleness=2)
    _two_steps(pr)
    pr.dispatch(2, 20)
    pr.arrived(group(2, 0, sample((0, 0)), sample((0, 0), (2, 3))))  # one sample ended on version 0: newest 0 + 1 < 2
    pr.arrived(group(2, 1, sample((1, 0), (2, 1))))  # deadline min(2 + 1, 1 + 2) = 3
    pr.arrived(group(3, 1, sample((2, 0))))  # deadline 3
    pr.take(2, 1, noop, noop)
    assert pr.dropped == 1 and pr.open[(2, 0)].to_send  # dropped, to be regenerated
    assert (2, 1) not in pr.open and (3, 1) not in pr.open  # the two within the rule are trained
    # group (3, 0), sent with version 0, kept sampling up to version 3: at step 3 its oldest token is 3 behind,
    # over the second cap (S_old = 2) however fresh its newest: deadline min(3 + 1, 0 + 2) = 2 < 3
    pr.dispatch(3, 20)
    pr.arrived(group(3, 0, sample((0, 0), (3, 2))))
    pr.arrived(group(4, 0, sample((3, 0))))
    pr.arrived(group(4, 1, sample((3, 0))))
    batch = pr.take(3, 1, noop, noop)
    assert pr.dropped == 2 and origins(batch) == [[4, 0], [4, 1]]


def test_earliest_deadline_trains_first():
    pr = PartialRollouts(P, 1, 1, Book(), max_oldest_staleness=3)
    _two_steps(pr)
    pr.arrived(group(2, 0, sample((0, 0), (3, 2))))  # oldest 0, newest 3: deadline min(4, 3) = 3
    pr.arrived(group(2, 1, sample((2, 0))))  # oldest = newest = 2: deadline 3
    pr.arrived(group(3, 0, sample((1, 0))))  # ended on version 1: deadline 2, the most urgent
    batch = pr.take(2, 1, noop, noop)
    assert origins(batch) == [[3, 0], [2, 0]]  # deadline 2, then the tie at 3 in stream order


def test_configuration_of_the_rule(make_config):
    stream = dict(generator_backend="vllm", generation_mode="stream", weight_load="in_flight", partial_rollouts=2)
    config = make_config(staleness_bound="newest", max_staleness=2, **stream)
    assert config.max_oldest_staleness == 4 and config.max_token_staleness() == 4  # default: 2 x max_staleness
    assert make_config(max_staleness=2).max_token_staleness() == 2  # "oldest": max_staleness
    with pytest.raises(ConfigError, match="staleness_bound: 'newest' needs partial_rollouts >= 1"):
        make_config(staleness_bound="newest")
    with pytest.raises(ConfigError, match="max_oldest_staleness: 3 is only used with staleness_bound='newest'"):
        make_config(max_oldest_staleness=3)
    with pytest.raises(ConfigError, match="max_oldest_staleness: must be an integer >= max_staleness=2, got 1"):
        make_config(staleness_bound="newest", max_staleness=2, max_oldest_staleness=1, **stream)
    with pytest.raises(ConfigError, match="staleness_bound: 'newer' is not one of"):
        make_config(staleness_bound="newer")


def test_auto_correction_is_the_clipped_ratio_at_every_staleness(make_config):
    # no correction beat the clipped ratio on the sorting task, for RLOO, PPO or GRPO (five seeds:
    # evals/results/sorting_corrections_seeds45/NOTES.md, evals/results/sorting_grpo_tis/NOTES.md)
    for config_cls in (AsyncRLOOConfig, AsyncPPOConfig, AsyncGRPOConfig):
        for fields in ({"max_staleness": 0}, {"max_staleness": 1}, {"num_mini_batches": 4}, {"num_mini_batches": 16},
                       {"max_staleness": 4}):
            assert make_config(config_cls, **fields).off_policy_correction == "none", (config_cls, fields)
    assert make_config(AsyncRLOOConfig, max_staleness=1, off_policy_correction="tis").off_policy_correction == "tis"
    assert not hasattr(make_config(AsyncOnlineDPOConfig), "off_policy_correction")  # DPO: no importance ratio
