"""The fault campaign's quick form (`benchmarks/faults.py --quick`): a few runs killed with SIGKILL at random moments
(learner rank 0, a generator, the whole launch; before the first step, mid-generation, mid weight sync, mid
checkpoint), each resumed and compared step by step with an uninterrupted run of the same seed. The full campaign
(at least 30 trials, with 2-rank launches) is run by hand: see docs/performance.md."""

from __future__ import annotations

import subprocess
import sys

import pytest
from session_run import ROOT


@pytest.mark.slow  # ~2 min on 2 cores: 4 trials of 2 short runs each, plus the uninterrupted runs
def test_quick_fault_campaign_every_trial_exact(tmp_path):
    proc = subprocess.run([sys.executable, "benchmarks/faults.py", "--trials", "4", "--quick", "--seed", "7",
                           "--dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "4/4 trials exact" in out, out[-6000:]
