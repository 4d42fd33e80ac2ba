"""The long-tail task end to end on its prepared models (`~/.cache/async_rlhf/longtail-v<N>`, built on first use:
about 15 minutes on a loaded 2-core CPU, so slow): its SFT policy samples heavy-tailed lengths, and
`recipes/online_dpo.py --task longtail` trains and evaluates with the real vLLM generator in both generation modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "evals"))

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_the_sft_policy_samples_heavy_tailed_lengths():
    import longtail_lengths

    out = longtail_lengths.main(["--num_prompts", "256"])
    sampled, ideal = out["policy_sampled"], out["ideal"]
    assert sampled["n"] == 512 and 0.5 * ideal["mean"] < sampled["mean"] < 2 * ideal["mean"], out
    assert sampled["cv"] > 0.6 and sampled["max"] > 4 * sampled["mean"], sampled
    assert sampled["longest_of_16_over_mean"] > 2.0, sampled
    assert sampled["cut_at_cap"] < 0.05, sampled  # it stops: the tail is the posts', not runaway sampling


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_the_recipe_trains_and_evaluates_on_the_long_tail_task(tmp_path, mode):
    out = tmp_path / "run"
    cmd = [sys.executable, os.path.join(ROOT, "recipes", "online_dpo.py"), "--task", "longtail", "--max_steps", "3",
           "--per_device_train_batch_size", "8", "--eval_prompts", "16", "--generation_mode", mode,
           "--output_dir", str(out)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((out / "eval_results.json").read_text())
    assert results["num_prompts"] == 16 and 0.0 <= results["gold_win_rate"] <= 1.0
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["steps"] == 3
