"""Several generator processes: every batch is split across them, every one receives every weight broadcast,
and the staleness bound holds across all of them."""

from __future__ import annotations

import pytest
from run_records import check_staleness_records

from async_rlhf import AsyncOnlineDPOConfig, AsyncOnlineDPOTrainer
from async_rlhf.data.toy_task import lowercase_reward, toy_prompts

pytestmark = pytest.mark.usefixtures("forked_generators")  # generators start as the recipes start them


@pytest.mark.parametrize("staleness,backend", [pytest.param(0, "transformers", marks=pytest.mark.slow), (1, "vllm"),
                                               pytest.param(1, "transformers", marks=pytest.mark.slow)])
def test_two_generators_share_each_batch_and_track_every_version(tmp_path, tiny_model_dir, staleness, backend):
    # transformers: batch-level (a chunk per generator); vllm: streamed groups, spread by expected token load
    if backend == "vllm":
        pytest.importorskip("vllm")
    steps = 4
    config = AsyncOnlineDPOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=5,
                                  max_new_tokens=6, max_length=48, generator_backend=backend,
                                  generator_devices=["cpu", "cpu"], generator_threads=1, max_staleness=staleness,
                                  learning_rate=1e-3, disable_tqdm=True, seed=0)
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                                    train_dataset=toy_prompts(40))
    trainer.train()
    s = trainer.run_summary
    assert s["generators"] == 2
    check_staleness_records(tmp_path, steps, staleness, s, dropped=0)
    # every generator acknowledged the last published version (steps - 1 is the last one a batch could need)
    assert set(s["generator_versions"]) == {0, 1}
    assert min(s["generator_versions"].values()) >= steps - 1
    assert s["generator_versions_pending"] == {}  # the run's end waited for every acknowledgement
    if backend == "vllm":  # streamed group by group: every batch reassembled whole, its token spread measured
        import json

        records = [json.loads(line) for line in (tmp_path / "trained_batches.jsonl").read_text().splitlines()]
        assert all(len(r["prompt_ids"]) == 5 for r in records)
        assert trainer.pipeline.records.imbalance.batches == steps  # one imbalance figure per streamed batch
        assert trainer.pipeline.scoring.seconds > 0  # rank 0 scored the groups as they arrived
        assert all(m.get("scoring/hidden_fraction", 0) >= 0 for m in trainer.state.log_history)


@pytest.mark.slow  # an experimental schedule (experimental/tail_migration/)
def test_tail_migration_hands_each_batch_tail_to_one_generator(tmp_path, tiny_model_dir):
    """`tail_migration`: a training run whose batches' last groups are handed to one generator mid-sample trains
    every batch whole, once, within the staleness bound for every token (from the run's own records)."""
    pytest.importorskip("vllm")
    steps = 4
    config = AsyncOnlineDPOConfig(output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=5,
                                  max_new_tokens=200, max_length=240, generator_backend="vllm",
                                  generator_devices=["cpu", "cpu"], generator_threads=1, max_staleness=1,
                                  weight_load="in_flight", tail_migration=4, learning_rate=1e-3, disable_tqdm=True,
                                  seed=0)
    # heavy-tailed budgets (lognormal, mean 40 tokens, cv 1, cap 200): a batch's last groups are its long ones
    trainer = AsyncOnlineDPOTrainer(tiny_model_dir, reward_funcs=lowercase_reward, args=config,
                                    train_dataset=toy_prompts(40, lengths=(40.0, 1.0, 200)))
    trainer.train()
    s = trainer.run_summary
    check_staleness_records(tmp_path, steps, 1, s, dropped=0)
    import json

    records = [json.loads(line) for line in (tmp_path / "trained_batches.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(steps)) and all(len(r["prompt_ids"]) == 5 for r in records)
    tail = s["tail_migration"]
    assert tail["handoffs"] >= 1 and tail["moved"] >= 1 and tail["moved_tokens"] > 0, tail
