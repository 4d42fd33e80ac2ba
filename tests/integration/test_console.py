"""What a new user's console shows: the README's `accelerate launch` command runs as printed on a CPU machine after
`scripts/install.sh` (no list of launch defaults accelerate chose), each fact is shown once (transformers' WANDB
offline notice is not repeated by every generator process) and the generators' known-harmless vLLM warnings stay in
their log files."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from session_run import ROOT

README_COMMAND = "accelerate launch recipes/online_dpo.py --output_dir outputs/online_dpo"
# the README's command, on the toy task for a test's budget, with two generator processes (each one used to print
# transformers' WANDB notice once more)
TEST_FLAGS = ["--task", "toy", "--max_steps", "2", "--generator_backend", "transformers", "--generator_devices",
              "cpu", "cpu", "--generator_start_timeout", "300", "--rollout_timeout", "300"]


def _fresh_shell_env(tmp_path) -> dict:
    """A new user's shell: no WANDB_MODE, OMP_NUM_THREADS or DS_ACCELERATOR of the test session's, accelerate's
    default config in a folder of the test's own (HF_HOME)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "OMP_NUM_THREADS", "DS_ACCELERATOR")}
    env.update(HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=ROOT + os.pathsep + env.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    return env


def test_readme_accelerate_launch_runs_as_printed_and_shows_each_fact_once(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert f"\n{README_COMMAND}\n" in readme, "README.md no longer shows the accelerate launch command"
    env = _fresh_shell_env(tmp_path)
    # what scripts/install.sh does for accelerate (the rest of it installs packages)
    step = subprocess.run([sys.executable, "launch/accelerate/install_default_config.py"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert step.returncode == 0, step.stderr
    out = tmp_path / "run"
    cmd = README_COMMAND.replace("outputs/online_dpo", str(out)).split() + TEST_FLAGS
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)  # one stream, interleaved as on a console
    console = proc.stdout
    assert proc.returncode == 0, console[-4000:]
    assert (out / "run_summary.json").is_file()
    assert "had defaults used instead" not in console, console[:2000]  # accelerate's list of chosen defaults
    assert console.count("Running in WANDB offline mode") <= 1, console[:3000]
    assert "Traceback" not in console
    # transformers' bars for the run's quick loads and its save (policy, reference, evaluation): nothing to read
    assert "Loading weights" not in console and "Writing model shards" not in console, console[-3000:]
    # off a terminal, the metric dicts follow one another with nothing between them: no tqdm redraws, which a viewer
    # that breaks lines at "\r" (a CI log, a `tee`d file) shows as a column of blank lines
    lines = re.split(r"\r\n|\r|\n", console)
    dicts = [i for i, line in enumerate(lines) if line.startswith("{'loss'")]
    assert len(dicts) == 2, console[-3000:]
    assert dicts[1] == dicts[0] + 1, lines[dicts[0]:dicts[-1] + 1]


def test_generator_console_leaves_vllm_dist_ident_warning_in_the_log(tmp_path):
    """vLLM's CPU worker sets VLLM_DIST_IDENT in its process; an engine built after that (or a process spawned from
    it) warns that vLLM does not know the variable. That warning, raised here by vLLM's own check, reaches the
    generator's log file and not the console."""
    pytest.importorskip("vllm")
    log = tmp_path / "generator-0.log"
    code = ("import os, sys; sys.path.insert(0, %r)\n"
            "from async_rlhf.generation.engine.process_log import route_output\n"
            "route_output(%r, 'generator-0')\n"
            "os.environ['VLLM_DIST_IDENT'] = 'abc'\n"
            "from vllm.platforms import current_platform\n"
            "current_platform.validate_environ(False)\n"
            "import logging; logging.getLogger('vllm.test').warning('a real problem')\n") % (ROOT, str(log))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a real problem" in proc.stderr  # the console still shows real problems
    assert "VLLM_DIST_IDENT" not in proc.stderr, proc.stderr[-2000:]
    assert re.search(r"Unknown vLLM environment variable detected: VLLM_DIST_IDENT", log.read_text())
