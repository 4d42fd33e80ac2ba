"""Directories a run keeps in RAM (`shm_dir`, /dev/shm by default), and removing the ones a killed run left behind.

Two kinds: the weight transport's `async_rlhf-weights-*` (one file per policy version, `shm.py`) and the generators'
starting copy of the policy, `async_rlhf-init-*` (`generation/pool/placement.py`). Both are `OwnedDir`s.

Ownership is a lock, not a pid. Each directory holds a lock file (`owner.lock`) that its owner keeps open with an
exclusive `flock` for as long as it uses the directory. The kernel drops the lock when the owner exits in any way,
`kill -9` included, so "nobody holds the lock" means "the owner is gone", wherever the owner ran: a /dev/shm shared
between containers (`--ipc=host`) holds directories of processes in other pid namespaces, whose pids mean nothing
here (deciding by pid deleted live runs' weights). `remove_orphaned_dirs` deletes a directory only while holding its
lock itself.

Guarantees:
* a directory is never seen under its final name without a held lock: it is created under a hidden name
  (`.async_rlhf-...`), locked, then renamed into place, so a clean-up running meanwhile cannot take it for a dead one;
* clean-up touches only directories of this user whose lock file it can lock; a directory without a lock file
  (made by an older version of this library) is left alone: delete it by hand once its run is gone;
* the lock file descriptor is not inherited by spawned processes (close-on-exec); a forked child would share the
  lock, which only keeps the directory longer.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import socket
import stat
import tempfile

logger = logging.getLogger(__name__)

WEIGHTS_PREFIX = "async_rlhf-weights-"
INIT_PREFIX = "async_rlhf-init-"
PREFIXES = (WEIGHTS_PREFIX, INIT_PREFIX)
LOCK_NAME = "owner.lock"


class OwnedDir:
    """A fresh directory `<parent>/<prefix>XXXXXXXX` (mode 0700), locked by this object until `close`."""

    def __init__(self, parent: str, prefix: str):
        for _ in range(100):
            hidden = tempfile.mkdtemp(prefix="." + prefix, dir=parent)
            fd = os.open(os.path.join(hidden, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: nobody else can hold it
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode())  # for people, not for clean-up
            path = os.path.join(parent, os.path.basename(hidden)[1:])
            try:
                os.rename(hidden, path)  # refused if a directory of that name exists (it holds a lock file)
            except OSError as exc:
                os.close(fd)
                shutil.rmtree(hidden, ignore_errors=True)
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                    raise
                continue
            self.path, self._fd = path, fd
            return
        raise FileExistsError(f"could not create a directory {prefix}* in {parent}")

    def close(self, remove: bool = True) -> None:
        """Remove the directory (while still holding its lock), then release the lock. Idempotent."""
        if self._fd is None:
            return
        if remove:
            shutil.rmtree(self.path, ignore_errors=True)
        os.close(self._fd)
        self._fd = None


def _try_lock(path: str) -> int | None:
    """An fd holding `path`'s lock file locked, or None if its owner holds it (or it is not ours to take)."""
    try:
        fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # no lock file (older version, or not ours), or no permission
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: the owner is alive
        os.close(fd)
        return None
    return fd


def remove_orphaned_dirs(shm_dir: str, prefixes: tuple[str, ...] = PREFIXES) -> list[str]:
    """Remove this user's directories in `shm_dir` (names starting with one of `prefixes`) whose owner is gone, that
    is whose lock nobody holds; returns their paths."""
    removed = []
    for name in sorted(os.listdir(shm_dir)):
        if not name.startswith(prefixes):
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        fd = _try_lock(path)
        if fd is None:
            continue
        try:
            shutil.rmtree(path, ignore_errors=True)
        finally:
            os.close(fd)
        removed.append(path)
    if removed:
        logger.info("removed %d directories left in %s by killed runs: %s", len(removed), shm_dir, removed)
    return removed
