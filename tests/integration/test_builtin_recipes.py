"""SFT and reward-model recipes and the gold evaluation on the built-in task (small settings), and the cache."""

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "recipes"))
sys.path.insert(0, ROOT)

import reward_model as reward_model_recipe  # noqa: E402
import sft as sft_recipe  # noqa: E402

from async_rlhf.data import builtin_task
from async_rlhf.data.tiny_model import tiny_llama  # noqa: E402
from async_rlhf.data.tokenizer import build_tokenizer  # noqa: E402
from async_rlhf.tasks import build_builtin as prepare
from async_rlhf.tasks.evaluation import evaluate_policy  # noqa: E402


@pytest.fixture(scope="module")
def sft_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft")
    sft_recipe.main(["--output_dir", str(out), "--steps", "200", "--num_layers", "2", "--num_examples", "2048",
                     "--batch_size", "32",
                     "--eval_prompts", "128"])
    return out


def test_sft_beats_random_init_on_gold_reward(sft_dir):
    results = json.loads((sft_dir / "sft_eval.json").read_text())
    tokenizer = build_tokenizer()
    random_policy = tiny_llama(tokenizer, 128, 2, 4, max_position_embeddings=128, seed=0)
    baseline = evaluate_policy(random_policy, None, num_prompts=128, tokenizer=tokenizer)
    assert results["gold_reward"] > baseline["gold_reward"] + 0.5, (results, baseline)
    assert results["gold_win_rate"] > baseline["gold_win_rate"]
    assert results["truncated_fraction"] < 0.2  # it learned to stop


def test_reward_model_beats_chance_on_held_out_pairs(sft_dir, tmp_path):
    metrics = reward_model_recipe.main(["--sft_model_path", str(sft_dir), "--output_dir", str(tmp_path / "rm"),
                                        "--num_pairs", "512", "--num_eval_pairs", "256", "--epochs", "2"])
    assert metrics["eval_pairs"] > 150
    assert metrics["eval_accuracy"] > 0.56, metrics  # chance is 0.5
    assert json.loads((tmp_path / "rm" / "reward_model_metrics.json").read_text()) == metrics


def test_evaluate_script_writes_the_metrics_of_each_checkpoint(sft_dir, tmp_path, capsys):
    sys.path.insert(0, os.path.join(ROOT, "evals"))
    import evaluate as evaluate_script

    out = tmp_path / "results.json"
    evaluate_script.main(["--model_name_or_path", str(sft_dir), str(sft_dir), "--sft_model_path", str(sft_dir),
                          "--num_prompts", "64", "--output_file", str(out)])
    results = json.loads(out.read_text())
    assert len(results) == 2
    for key in ("gold_win_rate", "gold_reward", "kl", "sft_perplexity"):
        assert key in results[0]
    assert abs(results[0]["kl"]) < 1e-4  # the SFT model against itself
    assert results[0]["sft_perplexity"] > 1.0
    assert "| " + str(sft_dir) in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a saved model"):
        evaluate_script.main(["--model_name_or_path", str(tmp_path)])


def test_prepare_builtin_caches_rebuilds_on_new_version_and_never_leaves_half_a_cache(tmp_path, monkeypatch):
    builds = []

    def fake_build(directory, seed=0, sft=None, reward=None, *task_and_positions):  # the cache logic is under test, not the training
        builds.append(directory)
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "manifest.json"), "w") as f:
            json.dump({"task_version": builtin_task.TASK_VERSION, "sft_gold_win_rate": 0.3, "sft_gold_reward": 1.0,
                       "reward_model": {"eval_accuracy": 0.7}, "timings": {"total_seconds": 0.0}}, f)
        return json.load(open(os.path.join(directory, "manifest.json")))

    monkeypatch.setattr(prepare, "build_into", fake_build)
    cache = tmp_path / "cache"
    paths = prepare.prepare_builtin(str(cache))
    assert len(builds) == 1 and os.path.exists(paths["manifest"])
    prepare.prepare_builtin(str(cache))
    assert len(builds) == 1  # finished cache: skipped
    monkeypatch.setattr(builtin_task, "TASK_VERSION", builtin_task.TASK_VERSION + 1)
    prepare.prepare_builtin(str(cache))
    assert len(builds) == 2  # new task version: rebuilt

    def failing_build(directory, seed=0, sft=None, reward=None, *task_and_positions):
        os.makedirs(os.path.join(directory, "sft_model"))
        raise RuntimeError("killed half way")

    monkeypatch.setattr(prepare, "build_into", failing_build)
    other = tmp_path / "other"
    with pytest.raises(RuntimeError, match="killed half way"):
        prepare.prepare_builtin(str(other))
    assert not other.exists()
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
