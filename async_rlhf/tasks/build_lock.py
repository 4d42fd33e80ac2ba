"""The lock that serialises builds of one cache directory between processes (ranks of `accelerate launch`, two
terminals): an exclusive `flock` on `<cache_dir>.lock`, which the kernel releases when its holder exits, however it
exits. Waiting is bounded: a waiter logs every LOCK_LOG_EVERY seconds and gives up after its timeout, naming the lock
file and the holder's pid (written into the file), instead of hanging forever behind a stuck build.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time

logger = logging.getLogger(__name__)

BUILD_LOCK_TIMEOUT = 3600.0  # seconds to wait for another process's build (one takes a few minutes on a CPU)
LOCK_LOG_EVERY = 30.0


@contextlib.contextmanager
def build_lock(path: str, timeout: float = BUILD_LOCK_TIMEOUT):
    """Hold the exclusive lock on `path`; while another process holds it, log every LOCK_LOG_EVERY seconds and give
    up after `timeout` seconds with a TimeoutError naming the lock file (the holder's pid is written in it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+") as f:  # not "w": that would erase the holder's pid
        start = last_log = time.monotonic()
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - start >= timeout:
                    f.seek(0)
                    holder = f.read().strip() or "unknown"
                    raise TimeoutError(f"build lock {path}: still held by pid {holder} after {timeout:g} s; if no "
                                       "such build is running, delete the lock file") from None
                if now - last_log >= LOCK_LOG_EVERY:
                    logger.info("waiting for the build lock %s (held by another process) for %.0f s of %g s",
                                path, now - start, timeout)
                    last_log = now
                time.sleep(min(0.5, max(0.0, timeout - (now - start))))
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
