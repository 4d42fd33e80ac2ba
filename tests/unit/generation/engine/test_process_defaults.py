"""A recipe's process sets its environment defaults before the libraries read them: on a machine without a GPU,
DeepSpeed no longer warns "Setting accelerator to CPU ... we were unable to detect it" on every run."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = next(str(p) for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
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


BARS = """
import sys, tempfile
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.utils import logging as hf_logging
model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=16))
path = tempfile.mkdtemp()

def save_and_load():
    model.save_pretrained(path)
    GPT2LMHeadModel.from_pretrained(path)
    print("---", file=sys.stderr, flush=True)

save_and_load()
from async_rlhf.config.cli import delayed_bars, set_process_defaults
set_process_defaults()
save_and_load()
mine = lambda factory, args, kwargs: factory(*args, **kwargs)
hf_logging.set_tqdm_hook(mine)
set_process_defaults()
print(hf_logging.set_tqdm_hook(None) is mine)
"""


def test_transformers_bars_for_loads_that_take_no_time_are_not_shown():
    """A recipe's console shows no "Loading weights" bar for each of its quick loads (policy, reference,
    evaluations) nor "Writing model shards" for its save; before the defaults both print, and a tqdm hook the user
    set is left in place."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", BARS], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = proc.stderr.split("---")[:2]
    assert "Loading weights" in before and "Writing model shards" in before, before[-1000:]
    assert "Loading weights" not in after and "Writing model shards" not in after, after[-1000:]
    assert proc.stdout.splitlines()[-1] == "True"
