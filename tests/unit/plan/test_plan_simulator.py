"""The pipeline simulator's basic properties (`async_rlhf/plan/simulator.py`), the planner CLI and run feedback."""

from __future__ import annotations

import types

import pytest

from async_rlhf.plan.cli import main as plan_main
from async_rlhf.plan.feedback import feedback, format_feedback
from async_rlhf.plan.simulator import EngineModel, SimConfig, simulate

ENGINE = EngineModel(overhead=0.01, compute_per_seq=0.001)


def cfg(**kw) -> SimConfig:
    base = dict(steps=6, max_staleness=0, prompts_per_step=4, n=2, engine=ENGINE, lengths=[10], train_seconds=0.5,
                sync_seconds=0.05, load_seconds=0.02)
    return SimConfig(**{**base, **kw})


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_staleness_0_is_the_sequential_sum(mode):
    # one batch: 8 sequences of 10 tokens, 10 steps of 0.01 + 8 x 0.001 s = 0.18 s; then train 0.5 + sync 0.05;
    # every batch after the first waits for the new weights to load (0.02 s)
    r = simulate(cfg(mode=mode))
    assert r.total_seconds == pytest.approx(6 * 0.18 + 5 * 0.02 + 6 * 0.55)
    assert r.staleness == {0: 6}


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_staleness_1_overlaps_generation_with_training(mode):
    sync = simulate(cfg(mode=mode, steps=12))
    asyn = simulate(cfg(mode=mode, steps=12, max_staleness=1))
    assert asyn.total_seconds < sync.total_seconds
    # learner-bound (0.55 s a step against 0.2 s of generation): in steady state a step is the learner's time
    assert asyn.steady_step_seconds == pytest.approx(0.55)
    assert set(asyn.staleness) <= {0, 1}


@pytest.mark.parametrize("mode", ["batch", "stream"])
@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_more_generators_never_slower_when_generation_bound(mode, staleness):
    lengths = [3, 8, 20, 40]
    times = [simulate(cfg(mode=mode, max_staleness=staleness, prompts_per_step=16, lengths=lengths,
                          train_seconds=0.02, generators=g, steps=10)).total_seconds for g in (1, 2, 4)]
    assert times[0] >= times[1] >= times[2]
    assert times[2] < times[0]


def test_staleness_never_exceeds_the_bound_and_reaches_it_when_learner_bound():
    for s in range(5):
        r = simulate(cfg(max_staleness=s, steps=20, sync_every=1))
        assert max(r.staleness) <= s
        assert r.staleness[s] >= 20 - 2 * s  # generation is fast: batches wait the full S steps


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="sync_every"):
        cfg(max_staleness=0, sync_every=2)
    with pytest.raises(ValueError, match="lengths"):
        cfg(lengths=[])


def summary(**kw) -> dict:
    s = {"steps": 20, "loop_seconds": 15.0, "train_seconds": 12.0, "sync_seconds": 0.2, "generate_seconds": 9.0,
         "generator_busy_seconds": 8.5, "generated_tokens": 6600, "sync_load_seconds": 1.0, "syncs": 20,
         "rollout_latency_seconds": 16.0, "handoff_seconds": 2.8, "timed_batches": 20, "generators": 1,
         "completion_length_counts": {"4": 300, "5": 500, "6": 480}, "max_staleness": 1, "sync_every": 1,
         "generation_mode": "stream", "regenerated": 0}
    return {**s, **kw}


def test_feedback_predicts_the_run_and_never_raises():
    args = types.SimpleNamespace(prompts_per_step=32, num_generations=2, generator_devices=["cpu"])
    f = feedback(summary(), args, learners=1)
    assert f["measured_step_seconds"] == pytest.approx(0.75)
    assert 0.3 < f["predicted_step_seconds"] < 1.5
    assert "simulated" in format_feedback(f)
    # S = 0 on a learner-bound run: the simulator says S = 1 would be faster, and by how much
    f0 = feedback(summary(max_staleness=0), args, learners=1)
    assert f0["suggestion"]["change"].startswith("max_staleness") and f0["suggestion"]["speedup"] > 1.1
    assert feedback({"steps": 20}, args, learners=1) == {}  # missing fields: no feedback, no exception
    assert format_feedback({}) == ""


def test_plan_cli_prints_a_table_and_the_command(capsys):
    assert plan_main(["--model_size", "8B", "--gpus", "8", "--gpu_type", "H100", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "PREDICTED" in out and "| plan | step s |" in out
    assert "accelerate launch --config_file launch/accelerate/" in out and "recipes/online_dpo.py HUB" in out
    assert plan_main(["--model_size", "70B", "--gpus", "2", "--gpu_type", "A100"]) == 1  # nothing fits
    assert "no plan fits" in capsys.readouterr().out
    assert plan_main(["--model_size", "8B", "--gpus", "8", "--gpu_type", "TPU"]) == 2
    assert "gpu_type" in capsys.readouterr().err


def test_scoring_thread_serves_parts_one_after_another():
    # batch-level, one generator: one part per batch; scoring it (0.1 s) adds to every synchronous step
    base = simulate(cfg(mode="batch"))
    scored = simulate(cfg(mode="batch", score_seconds=0.1))
    assert scored.total_seconds == pytest.approx(base.total_seconds + 6 * 0.1)
    # streaming: 4 groups a batch each wait for the scoring of the groups before them; with 1 s per part the
    # scoring thread (4 s a batch) sets the pace once generation overlaps training
    slow = simulate(cfg(max_staleness=2, steps=12, score_seconds=1.0))
    assert slow.steady_step_seconds == pytest.approx(4.0, rel=1e-6)
