"""Where prepared tasks are cached, and how a cache directory is written so that readers never see half of one.

Used by `tasks/build_builtin.py` (the built-in and long-tail tasks) and `tasks/smollm2.py`; the guarantees are stated in
`build_builtin.py`'s docstring.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Callable

from async_rlhf.data import builtin_task
from async_rlhf.tasks.build_lock import build_lock


def cache_root() -> str:
    """Where prepared models live: `$ASYNC_RLHF_CACHE`, else `~/.cache/async_rlhf`."""
    return os.environ.get("ASYNC_RLHF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "async_rlhf")


def default_cache_dir(seed: int = 0, task=builtin_task) -> str:
    return os.path.join(cache_root(), f"{task.NAME}-v{task.TASK_VERSION}" + (f"-seed{seed}" if seed else ""))


def _paths(cache_dir: str) -> dict:
    return {
        "cache_dir": cache_dir,
        "tokenizer": os.path.join(cache_dir, "tokenizer"),
        "sft_model": os.path.join(cache_dir, "sft_model"),
        "reward_model": os.path.join(cache_dir, "reward_model"),
        "manifest": os.path.join(cache_dir, "manifest.json"),
    }


def _is_complete(cache_dir: str, task=builtin_task) -> bool:
    manifest = _paths(cache_dir)["manifest"]
    if not os.path.exists(manifest):
        return False
    with open(manifest) as f:
        return json.load(f).get("task_version") == task.TASK_VERSION


@contextlib.contextmanager
def built_atomically(directory: str):
    """Yield a temporary sibling of `directory` to build into; on success it replaces `directory` (a rename), on any
    error it is removed: readers never see half a build."""
    tmp = tempfile.mkdtemp(prefix=os.path.basename(directory) + ".tmp-", dir=os.path.dirname(directory))
    try:
        yield tmp
        if os.path.exists(directory):  # a stale or unfinished build of this name: replace it
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def build_once(cache_dir: str, task, build: Callable[[str], None]) -> dict:
    """The paths of `task`'s cache in `cache_dir`, which `build(cache_dir)` makes unless it is complete already: under
    the directory's lock, so that one process builds while the others wait and then reuse it (`build_lock.py`)."""
    paths = _paths(cache_dir)
    if _is_complete(cache_dir, task):
        return paths
    with build_lock(cache_dir.rstrip("/") + ".lock"):
        if not _is_complete(cache_dir, task):  # else another process built it while we waited
            build(cache_dir)
    return paths
