"""Waits that used to be unbounded or silent: the built-in task's build lock (logs while waiting, times out naming
the lock file, the holder's pid and the timeout) and a reward function that always raises under reward_failure='skip'
(logged once with its exception, counted on every call)."""

from __future__ import annotations

import fcntl
import logging
import math
import multiprocessing
import os
import time

import pytest

from async_rlhf.tasks import build_lock as build_lock_module
from async_rlhf.tasks.build_lock import build_lock
from async_rlhf.scoring.rewards import RewardScorer


def _hold(path: str, ready, release) -> None:
    with build_lock(path):
        ready.set()
        release.wait(30)


def test_build_lock_logs_while_waiting_and_times_out_naming_the_file(tmp_path, caplog, monkeypatch):
    path = str(tmp_path / "builtin-v1.lock")
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold, args=(path, ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        monkeypatch.setattr(build_lock_module, "LOCK_LOG_EVERY", 0.2)
        caplog.set_level(logging.INFO, logger="async_rlhf.tasks.build_lock")
        t0 = time.monotonic()
        with pytest.raises(TimeoutError, match=rf"build lock {path}: still held by pid {holder.pid} after 1.5 s"):
            with build_lock(path, timeout=1.5):
                pass
        assert 1.5 <= time.monotonic() - t0 < 10
        assert f"waiting for the build lock {path}" in caplog.text
    finally:
        release.set()
        holder.join(30)
    with build_lock(path, timeout=5):  # released by its holder: taken at once, and our pid is recorded
        assert open(path).read() == str(os.getpid())
        with open(path) as other:  # a second open file description conflicts, as another process would
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)


def always_fails(prompts, completions, **kw):
    raise KeyError("no 'answer' column")


def constant(prompts, completions, **kw):
    return [1.0] * len(completions)


def test_a_reward_that_always_raises_under_skip_is_logged_once_and_counted(caplog):
    scorer = RewardScorer([always_fails, constant], failure="skip")
    with caplog.at_level(logging.WARNING, logger="async_rlhf.scoring.rewards"):
        for _ in range(3):
            scores, _ = scorer.score(["p"] * 2, ["a", "b"], [[1], [2]], [True, True], [0, 0])
            assert all(math.isnan(s) for s in scores.tolist())
    warnings = [r for r in caplog.records if "always_fails" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert "KeyError" in warnings[0].getMessage() and "no 'answer' column" in warnings[0].getMessage()
    assert warnings[0].exc_info is not None  # the traceback is in the log
    assert scorer.raised == {"always_fails": 3} and scorer.skipped == 6
