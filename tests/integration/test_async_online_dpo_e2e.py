"""The real loop, end to end: `accelerate launch` with 2 learner ranks over gloo, a real vLLM generator process,
shared-memory weight broadcast, online DPO on a learnable reward, at max_staleness 0 (weights loaded once the
running samples end) and 2 (weights loaded in flight).

Everything is read back from the run's own records (run_summary.json, metrics.jsonl, trained_batches.jsonl) and
from the process table. The run at max_staleness 0 is in the slow tier (its guarantees have default-tier tests of
their own: `test_sync_parity.py`, `test_generation_backends.py`); each run starts only when a test asks for it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from run_records import RunsOnDemand, check_staleness_records
from session_run import ROOT, run_in_own_session

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them

STEPS = 14


def _launch(tmp_path, staleness: int, backend: str = "vllm", procs: int = 2) -> tuple[dict, list[dict], str, Path]:
    out = tmp_path / f"s{staleness}"
    launcher = ["accelerate", "launch", "--config_file",
                os.path.join(ROOT, "launch/accelerate", "cpu_2proc_gloo.yaml" if procs == 2 else "cpu_1proc.yaml")]
    cmd = launcher + [
        os.path.join(ROOT, "recipes/online_dpo.py"), "--task", "toy", "--output_dir", str(out),
        "--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--num_generations", "4",
        "--max_new_tokens", "12", "--max_length", "64", "--learning_rate", "1e-2", "--beta", "0.1",
        "--lr_scheduler_type", "constant", "--disable_tqdm", "true",
        "--temperature", "1.0", "--max_staleness", str(staleness), "--sync_every", "1",
        "--generator_backend", backend, "--rollout_timeout", "300", "--seed", "1",
        # the stale run loads weights in flight: its records then hold per-token versions, checked sample by sample
        "--weight_load", "in_flight" if staleness else "drain",
        "--reference_while_generating", "true",  # rank 0 runs the reference for both ranks' rows
    ]
    log = run_in_own_session(cmd, timeout=900)
    summary = json.loads((out / "run_summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, [m for m in metrics if "loss" in m], log, out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    return RunsOnDemand(lambda staleness: _launch(tmp, staleness))


BOTH = [pytest.param(0, marks=pytest.mark.slow), 2]


@pytest.mark.parametrize("staleness", BOTH)
def test_staleness_bound_held_for_every_trained_batch(runs, staleness):
    summary, _, log, out = runs[staleness]
    # dropped == 0: admission control paced generation; nothing had to be thrown away
    check_staleness_records(out, STEPS, staleness, summary, dropped=0)
    assert "=== async_rlhf run summary ===" in log
    assert "leaked semaphore" not in log  # a generator's os._exit used to skip unlinking tqdm's lock


def test_async_run_actually_overlaps(runs):
    summary, _, _, out = runs[2]
    staleness = check_staleness_records(out, STEPS, 2, summary)
    assert max(staleness) >= 1, f"max_staleness=2 never trained on a stale batch: {staleness}"


@pytest.mark.parametrize("staleness", BOTH)
def test_versions_advanced_and_weights_reached_the_generator(runs, staleness):
    summary, steps, _, _ = runs[staleness]
    assert summary["sync_bytes"] > 0
    # at the last step's log the generator holds at least the version that sampled that step's batch (the bound);
    # whether the newest update was acknowledged before that log line is a race, but the run's end waits for it
    assert steps[-1]["generator/version_loaded"] >= STEPS - 1 - staleness
    assert min(summary["generator_versions"].values()) >= STEPS - 1, summary["generator_versions"]
    # On-policy steps (every step at S = 0; a batch of the step's own version at S = 2, where in-flight loads keep
    # every token of it on that version): the generator sampled with exactly the learner's weights, so its
    # behaviour log-probs match the learner's own (same temperature) up to float noise, including after many syncs.
    on_policy = [m for m in steps if m["queue/staleness_of_batch"] == 0]
    assert len(on_policy) >= (STEPS if staleness == 0 else 1), [m["queue/staleness_of_batch"] for m in steps]
    for m in on_policy:
        assert abs(m["off_policy/chosen_log_ratio_mean"]) < 2e-3, m
        assert m["off_policy/chosen_log_ratio_abs_max"] < 2e-2, m


@pytest.mark.parametrize("staleness", BOTH)
def test_rank_0_scored_and_ran_the_reference_as_groups_arrived(runs, staleness):
    # inter-stage fusion: rewards and reference log-probs computed on rank 0's scoring thread for both ranks' rows
    last = runs[staleness][1][-1]
    assert last["scoring/reward_seconds"] > 0 and last["scoring/reference_seconds"] > 0, last
    assert 0 <= last["scoring/reference_hidden_fraction"] <= 1


def test_stale_samples_show_drift(runs):
    _, steps, _, _ = runs[2]
    late = [m for m in steps[4:] if m["queue/staleness_of_batch"] >= 1]
    assert late and max(m["off_policy/chosen_log_ratio_abs_max"] for m in late) > 2e-2


@pytest.mark.parametrize("staleness", BOTH)
def test_reward_goes_up_on_a_learnable_reward(runs, staleness):
    _, steps, _, _ = runs[staleness]
    first = sum(m["objective/scores"] for m in steps[:3]) / 3
    last = sum(m["objective/scores"] for m in steps[-3:]) / 3
    assert last > first + 0.15, (first, last)
    first_loss = sum(m["loss"] for m in steps[:3]) / 3
    last_loss = sum(m["loss"] for m in steps[-3:]) / 3
    assert last_loss < first_loss, (first_loss, last_loss)


@pytest.mark.parametrize("staleness", BOTH)
def test_summary_compares_the_step_time_with_the_simulator(runs, staleness):
    summary, _, log, _ = runs[staleness]
    plan = summary["plan"]  # plan/feedback.py: the simulator fed with this run's own stage times
    assert plan["measured_step_seconds"] == pytest.approx(summary["loop_seconds"] / summary["steps"])
    assert plan["predicted_step_seconds"] > 0
    assert "plan: step" in log


def test_the_summary_names_the_weights_the_run_started_from(runs):
    """run_summary.json's `initial_policy`: the toy policy's directory and a content hash of its weights, which is
    how evals/compare.py tells two builds of one policy apart."""
    from async_rlhf.trainers.provenance import fingerprint

    summary, _, _, out = runs[2]
    record = summary["initial_policy"]
    assert record["path"] == str(out / "init_model")
    assert (record["sha256"], record["content"]) == (fingerprint(str(out / "init_model"))["sha256"], True)
