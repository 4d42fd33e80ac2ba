"""trainers/provenance.py: a run's record of the weights it started from, and evals/compare.py's note when a cell
pools runs from two of them."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

from async_rlhf.trainers.provenance import fingerprint, initial_policy_record
from evals import compare
from evals.run_result import RunResult


def _model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))


def test_a_rebuilt_policy_with_other_weights_gets_another_fingerprint(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "a")
    model.save_pretrained(tmp_path / "b")  # the same weights elsewhere: the same fingerprint
    with torch.no_grad():
        model.transformer.wte.weight[0, 0] += 1e-3
    model.save_pretrained(tmp_path / "c")
    a, b, c = (fingerprint(str(tmp_path / d)) for d in "abc")
    assert a == b and a["content"] and a["files"] == 1
    assert c["sha256"] != a["sha256"] and c["bytes"] == a["bytes"]
    small = fingerprint(str(tmp_path / "a"), limit=16)  # above the limit: names and sizes only, flagged
    assert not small["content"] and small["sha256"] == fingerprint(str(tmp_path / "c"), limit=16)["sha256"]


def test_the_record_names_a_directory_a_hub_snapshot_or_an_in_memory_model(tmp_path):
    model = _model()
    model.save_pretrained(tmp_path / "policy")
    record = initial_policy_record(str(tmp_path / "policy"), model)
    assert record["path"] == str(tmp_path / "policy") and len(record["sha256"]) == 64
    model.config._commit_hash = "0123abcd"
    assert initial_policy_record("org/model", model) == {"path": "org/model", "commit": "0123abcd"}
    assert "sha256" not in initial_policy_record(None, model)  # in memory: nothing to hash


def _run(seed: int, sha: str | None) -> RunResult:
    summary = {"initial_policy": {"path": "/x", "sha256": sha}} if sha else {}
    return RunResult(name=f"a-N1-seed{seed}", algorithm="a", knob="num_mini_batches", knob_value=1, seed=seed,
                     axes={}, summary=summary, eval={"gold_reward": 1.0}, steps=[])


def test_compare_notes_a_cell_that_pools_two_initial_policies():
    one = {"a:1": {1: _run(1, "f" * 64), 2: _run(2, "f" * 64), 3: _run(3, None)}}
    assert compare.mixed_initial_policies(one) == []  # one recorded policy (and an unrecorded run): no note
    two = {"a:1": {1: _run(1, "f" * 64), 2: _run(2, "e" * 64), 3: _run(3, None)}}
    assert compare.mixed_initial_policies(two) == [
        "note: cell a:1 pools runs from 3 initial policies (ffffffffffff: seeds 1; eeeeeeeeeeee: seeds 2; "
        "unrecorded: seeds 3)"]
