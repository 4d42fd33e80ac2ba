"""Generators forked from a warm server: their imports done while the learner still imports its own.

Most of a transformers generator's start is importing torch, transformers and our backend (about 5 s of the 4-7 s
on the 2-core development CPU; `python -X importtime -c "import async_rlhf.generation.engine.hf_backend"`), and
before this the learner spawned its generators only once its own imports were done (8-14 s after process start).
`prewarm_generators()`, called first thing by the recipes, starts Python's fork server (`multiprocessing`'s
"forkserver" start method, with `set_forkserver_preload`) as a separate process that imports `PRELOAD` at once, on
another core, while the learner imports and loads; from then on `ProcessLauncher` starts each generator by forking
that server, so a generator starts with those modules already imported. Nothing else changes: a generator forked
this way runs the same `worker.generator_main`, with the learner's environment as it is when the generator is started
(`environ`, applied before anything reads it) rather than the server's, and dies with the learner as before: the
learner ends the server when it exits (or, killed, the server sees its pipe close), and the kernel's death signal
reaches the server's children.

Without `prewarm_generators()` (a trainer built in a user's script, the tests that build pools directly) generators are
spawned as before. Only learner rank 0 starts generators, so on other ranks it does nothing. vLLM is not preloaded:
the backend is decided later (`backend_choice.py`), and importing vLLM where transformers is chosen would cost 10-20 s
of CPU and patch torch's compiler in every generator.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import multiprocessing.forkserver
import os
import signal
import threading
import time

# imported by the fork server before its first fork: what every generator imports (both backends import torch and
# transformers; the transformers backend and the serve loops are ours)
PRELOAD = ("torch", "transformers", "async_rlhf.generation.engine.hf_backend",
           "async_rlhf.generation.engine.serve_loops")
# Variables a generator process must not inherit: transformers prints "[INFO] Running in WANDB offline mode" at
# import wherever WANDB_MODE is "offline", once per generator on the console otherwise. Generators never log to wandb.
NOT_INHERITED = ("WANDB_MODE",)

_warm = False


def prewarm_generators() -> bool:
    """Start the fork server now (learner rank 0 only: `RANK` unset or "0"), importing `PRELOAD` in the background;
    later generators fork from it. Returns whether it did (False on other ranks or where forkserver is missing)."""
    global _warm
    if _warm:
        return True
    if os.environ.get("RANK", "0") != "0" or "forkserver" not in mp.get_all_start_methods():
        return False
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    saved = {k: os.environ.pop(k) for k in NOT_INHERITED if k in os.environ}
    # Ctrl-C reaches the whole process group: the server starts with SIGINT ignored (as generators ignore it), so one
    # still importing does not print a KeyboardInterrupt of its own; the learner's handler is back right after
    main_thread = threading.current_thread() is threading.main_thread()
    interrupt = signal.signal(signal.SIGINT, signal.SIG_IGN) if main_thread else None
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.update(saved)
        if main_thread:
            signal.signal(signal.SIGINT, interrupt)
    atexit.register(_stop_server)
    _warm = True
    return True


def stop_prewarm() -> None:
    """End the fork server (if this process started one): generators started from now on are spawned again, and a
    later `prewarm_generators()` starts a new server. Generators already forked keep running."""
    global _warm
    if not _warm:
        return
    server = multiprocessing.forkserver._forkserver
    if server._forkserver_pid is not None:
        try:  # ended at once (it waits on no child), so that the reaping below cannot wait
            os.kill(server._forkserver_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        server._stop()  # closes its pipe, reaps it and forgets it (CPython's own tests stop it so)
    _warm = False


def _stop_server(timeout: float = 5.0) -> None:
    """At the learner's exit: end the fork server now (it would wait for its last child to close the learner's end of
    its pipe, up to the seconds a generator takes to leave; the kernel's death signal then ends any such child)."""
    pid = multiprocessing.forkserver._forkserver._forkserver_pid
    if pid is None:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return
        except ChildProcessError:  # not our child, or already reaped
            return
        time.sleep(0.02)


def warm() -> bool:
    """Whether generators are forked from the warm server (`prewarm_generators` ran in this process)."""
    return _warm


def generator_environ() -> dict[str, str]:
    """The environment a generator gets: the learner's now, less `NOT_INHERITED`."""
    return {k: v for k, v in os.environ.items() if k not in NOT_INHERITED}
