"""The GPU evidence kit's CPU dry run (`bash scripts/gpu_check.sh OUT --device cpu --dry_run`): every part runs the
code it runs on the GPU machine, at tiny sizes, and the three files a device call brings back are written. Slow: it
trains a few runs and needs the built-in task (built on first use)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile

import pytest
from session_run import ROOT

pytestmark = pytest.mark.slow


def test_gpu_kit_dry_run_runs_every_part_and_writes_its_report(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(out), "--device", "cpu", "--dry_run", "--work_dir",
                           str(work)], cwd=ROOT, capture_output=True, text=True, timeout=2400,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["gpu_kit.json", "gpu_kit.md", "logs.tar.gz"]  # a device call returns <= 8
    results = json.loads((out / "gpu_kit.json").read_text())
    parts = results["parts"]
    assert list(parts) == ["env", "mechanisms", "vs_trl_cb", "pytest_gpu", "continuous_batching", "cb_backend",
                           "learner_step", "colocated", "vs_trl"]
    assert {name: p["status"] for name, p in parts.items()} == dict.fromkeys(parts, "ok"), parts
    # the long-tail workload: the default run on the continuous-batching backend, every mechanism run or skipped
    # with a reason (none failed, none left out of time), and both trainers of the TRL comparison with timelines
    mech = parts["mechanisms"]
    assert mech["default"]["status"] == "ok" and mech["default"]["generation_mode"] == "stream"
    rows = {m["mechanism"]: m for m in mech["mechanisms"]}
    assert {m["status"] for m in rows.values()} <= {"ok", "skipped"}, rows
    assert all(m.get("reason") for m in rows.values() if m["status"] == "skipped")
    assert rows["streaming"]["status"] == "ok" and rows["streaming"]["clock_ratio"] > 0
    assert rows["speculative rollouts"]["status"] == "skipped" and "vLLM" in rows["speculative rollouts"]["reason"]
    cb = parts["vs_trl_cb"]
    assert {(r["trainer"], r["status"]) for r in cb["runs"]} == {("trl", "ok"), ("ours", "ok")}
    assert {"trainer_built", "first_step"} <= set(cb["startup"]["trl"])
    assert {"trainer_built", "generators_ready", "first_step"} <= set(cb["startup"]["ours"])
    assert len(parts["learner_step"]["sizes"]) == 2 and all("ms" in r for r in parts["learner_step"]["sizes"])
    cb = parts["continuous_batching"]
    assert cb["continuous"]["produced_tokens"] == cb["useful_tokens"] == cb["continuous"]["logprobs"]
    colocated = parts["colocated"]
    assert colocated["sync_seconds_per_gb"] > 0 and colocated["generator_tokens_per_s"] > 0
    assert colocated["async_speedup"] > 0 and colocated["planner"]["predicted_step_seconds"] > 0
    assert {r["trainer"] for r in parts["vs_trl"]["runs"]} == {"trl", "ours"}
    table = (out / "gpu_kit.md").read_text()
    assert table.startswith("Device: ") and "| colocated | weight sync, s per GB" in table and "not run" not in table
    assert "| mechanisms | streaming (" in table and "| vs_trl_cb | start-up, ours" in table
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert {"pytest_gpu.log", "continuous_batching.log", "learner_step.log", "colocated.log", "vs_trl.log",
                "mechanisms.log", "vs_trl_cb.log", "longtail/runs/default-seed0.log"} <= set(tar.getnames())


def test_a_part_that_fails_is_recorded_and_the_kit_goes_on(tmp_path):
    # --device cuda on a machine without a GPU: the env part fails; the next part still runs and is recorded
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    out = tmp_path / "out"
    proc = subprocess.run(["python3", "benchmarks/gpu_kit.py", "--output_dir", str(out), "--work_dir",
                           str(tmp_path / "work"), "--parts", "env", "pytest_gpu", "--budget", "600"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    parts = json.loads((out / "gpu_kit.json").read_text())["parts"]
    assert parts["env"]["status"] == "failed" and "no CUDA GPU" in parts["env"]["error"]
    assert parts["pytest_gpu"]["status"] == "ok"  # the GPU tests skip here; what matters is that it ran
    assert "| env | status | failed" in (out / "gpu_kit.md").read_text()
