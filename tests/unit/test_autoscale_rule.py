"""The autoscaling rule (`experimental/autoscale_rule.py`) on hand-worked windows, and the config errors of
`generator_autoscale` / `generator_launcher` (raised before any model loads)."""

from __future__ import annotations

import pytest

from async_rlhf import AsyncOnlineDPOConfig
from async_rlhf.errors import ConfigError
from async_rlhf.experimental.autoscale_rule import AutoscaleRule, Window, decide, predicted_step_seconds
from async_rlhf.config import checks
from async_rlhf.config.checks import ray_installed

# 2 steps in 2 s, the learner waited 1.2 s, one generator sampled 1.6 s:
# T = 1.0, W = 0.6, learner 0.4, B = 0.8 a batch, g(1) = 0.8
STARVED = Window(steps=2, seconds=2.0, wait_seconds=1.2, busy_seconds=1.6, generators=1)
# 4 steps in 4 s, no wait, two generators sampled 0.8 s together: T = 1.0, learner 1.0, B = 0.2, g(2) = 0.1,
# idle 1 - 0.8 / (2 * 4) = 0.9
IDLE = Window(steps=4, seconds=4.0, wait_seconds=0.0, busy_seconds=0.8, generators=2)


def test_adding_a_generator_removes_the_latency_it_saves_from_the_wait():
    # g(2) = 0.4: the wait drops by 0.8 - 0.4 to 0.2 (no slack: generation is the longer stage), T(2) = 0.4 + 0.2
    assert predicted_step_seconds(STARVED, 2, max_staleness=1) == pytest.approx(0.6)
    assert predicted_step_seconds(STARVED, 2, max_staleness=0) == pytest.approx(0.6)
    # cost at price 1: C(1) = (1 + 1) * 1.0 = 2.0, C(2) = (1 + 2) * 0.6 = 1.8 <= 0.95 * 2.0: add
    d = decide(AutoscaleRule(learners=1, max_staleness=1), STARVED, can_add=True, can_retire=False)
    assert (d.action, d.cost_now, d.wait_fraction) == ("add", pytest.approx(2.0), pytest.approx(0.6))
    assert d.cost_after == pytest.approx(1.8)
    # price 2: C(1) = 3 * 1.0 = 3.0, C(2) = 5 * 0.6 = 3.0 > 2.85: the wait removed does not pay for the device
    d = decide(AutoscaleRule(learners=1, max_staleness=1, generator_cost=2.0), STARVED, True, False)
    assert d.action == "hold" and "cost more" in d.reason
    # nothing free to add on
    d = decide(AutoscaleRule(learners=1, max_staleness=1), STARVED, can_add=False, can_retire=False)
    assert d.action == "hold" and "no spare device" in d.reason


def test_retiring_counts_the_slack_that_staleness_gives():
    # g(1) = 0.2 against g(2) = 0.1: +0.1 s of latency. S = 1: slack 1.0 - 0.1 = 0.9 absorbs it, T(1) = 1.0;
    # S = 0: generation and training alternate, T(1) = 1.1
    assert predicted_step_seconds(IDLE, 1, max_staleness=1) == pytest.approx(1.0)
    assert predicted_step_seconds(IDLE, 1, max_staleness=0) == pytest.approx(1.1)
    # price 0.1: C(2) = 1.2 * 1.0 = 1.2; S = 1: C(1) = 1.1 * 1.0 = 1.1 <= 1.14: retire;
    # S = 0: C(1) = 1.1 * 1.1 = 1.21 > 1.14: hold
    for staleness, action in ((1, "retire"), (0, "hold")):
        d = decide(AutoscaleRule(learners=1, max_staleness=staleness, generator_cost=0.1), IDLE, True, True)
        assert d.action == action, (staleness, d)
        assert d.idle_fraction == pytest.approx(0.9)
    # the last generator is never retired
    assert decide(AutoscaleRule(learners=1, max_staleness=1), IDLE, True, can_retire=False).action == "hold"


def test_thresholds_gate_the_rule():
    rule = AutoscaleRule(learners=1, max_staleness=1, wait_threshold=0.7, idle_threshold=0.95)
    assert decide(rule, STARVED, True, True).action == "hold"  # waited 60% < 70%
    assert decide(rule, IDLE, True, True).action == "hold"  # idle 90% < 95%


@pytest.mark.parametrize("fields,message", [
    ({"generator_autoscale": True}, r"generator_autoscale: no spare device"),
    ({"generator_autoscale_devices": ["cpu"]}, r"generator_autoscale_devices: \['cpu'\] given but generator_autoscale "
                                               r"is off"),
    ({"generator_autoscale": True, "generator_autoscale_devices": ["gpu0"]},
     r"generator_autoscale_devices: 'gpu0' is not 'cpu' or 'cuda:<index>'"),
    ({"generator_autoscale": True, "generator_devices": ["cuda:6"], "generator_autoscale_devices": ["cuda:6"]},
     r"repeats a GPU"),
    ({"generator_autoscale": True, "generator_autoscale_devices": ["cpu"], "generator_servers": ["127.0.0.1:8000"]},
     r"generator_autoscale: generator_servers are started and stopped by you"),
    ({"generator_autoscale": True, "generator_autoscale_devices": ["cpu"], "colocate": True}, r"not with colocate"),
    ({"generator_launcher": "slurm"}, r"generator_launcher: 'slurm' is not one of \('process', 'ray'\)"),
    ({"generator_autoscale_wait": 0.0}, r"generator_autoscale_wait: must be in \(0, 1\]"),
    ({"generator_autoscale_window": 0}, r"generator_autoscale_window: must be >= 1"),
    ({"generator_autoscale_cost": -1.0}, r"generator_autoscale_cost: must be >= 0"),
])
def test_bad_autoscale_settings_are_refused_naming_the_field(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), **fields)


def test_the_ray_launcher_needs_ray_and_no_servers(tmp_path, monkeypatch):
    if ray_installed():
        with pytest.raises(ConfigError, match=r"generator_launcher: 'ray' starts generators as Ray actors"):
            AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_launcher="ray",
                                 generator_servers=["127.0.0.1:8000"])
        assert AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_launcher="ray").generator_launcher == "ray"
    # a machine without Ray (the module lookup is what tells; here it is made to find nothing)
    monkeypatch.setattr(checks, "ray_installed", lambda: False)
    with pytest.raises(ConfigError, match=r"generator_launcher: 'ray' needs Ray, which is not installed here "
                                          r"\(pip install -r requirements-ray.txt\)"):
        AsyncOnlineDPOConfig(output_dir=str(tmp_path), generator_launcher="ray")


def test_an_addition_that_did_not_pay_is_undone():
    # before: 1 generator, T = 1.0 (STARVED): C = 2.0 at price 1. After: 2 generators measured at 0.7 s a step:
    # C = 3 * 0.7 = 2.1 >= 2.0, though 0.6 s was predicted: undo (retire), whatever the wait
    after = Window(steps=2, seconds=1.4, wait_seconds=0.6, busy_seconds=1.6, generators=2)
    rule = AutoscaleRule(learners=1, max_staleness=1)
    d = decide(rule, after, can_add=False, can_retire=True, before_add=STARVED)
    assert d.action == "retire" and d.reason.startswith("undo") and d.cost_after == pytest.approx(2.0)
    # measured at 0.6 s a step, as predicted: C = 1.8 < 2.0, kept
    kept = Window(steps=2, seconds=1.2, wait_seconds=0.4, busy_seconds=1.6, generators=2)
    assert decide(rule, kept, can_add=False, can_retire=True, before_add=STARVED).action == "hold"

    # the 2.1 measured with 2 is remembered: no new addition while 1 generator costs less than that ...
    d = decide(rule, STARVED, can_add=True, can_retire=False, undone_cost=2.1)
    assert d.action == "hold" and "when last tried" in d.reason
    # ... and one is tried again once it costs more (the workload grew: 1.1 s a step, C = 2.2)
    grown = Window(steps=2, seconds=2.2, wait_seconds=1.4, busy_seconds=1.8, generators=1)
    assert decide(rule, grown, can_add=True, can_retire=False, undone_cost=2.1).action == "add"
