"""A recipe's process sets its environment defaults before the libraries read them: on a machine without a GPU,
DeepSpeed no longer warns "Setting accelerator to CPU ... we were unable to detect it" on every run."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = "import deepspeed.accelerator as a; a.get_accelerator()"


@pytest.mark.parametrize("defaults, warned", [(False, True), (True, False)])
def test_deepspeed_is_told_it_runs_on_the_cpu(defaults, warned):
    env = {k: v for k, v in os.environ.items() if k not in ("DS_ACCELERATOR", "WANDB_MODE")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    code = ("from async_rlhf.config.cli import set_process_defaults; set_process_defaults(); " if defaults else "") + SCRIPT
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("Setting accelerator to CPU" in proc.stdout + proc.stderr) == warned
