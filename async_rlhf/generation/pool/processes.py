"""How a local generator process is started and ended: the default launcher (processes with `multiprocessing`
queues, spawned, or forked from the warm server of `prewarm.py` once a recipe started it; `ray_launcher.RayLauncher`
is the other) and the pool's bounded ways to stop them."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from contextlib import contextmanager
from multiprocessing.context import ForkServerProcess, SpawnProcess
from multiprocessing.reduction import ForkingPickler

from async_rlhf.generation.engine.worker import GeneratorSpec, generator_main
from async_rlhf.generation.pool.prewarm import NOT_INHERITED, generator_environ, warm


@contextmanager
def main_script_hidden(needed: bool):
    """While a process is spawned, hide the parent's main script from `multiprocessing`, so the child does not
    import it again as `__mp_main__` (unless `needed`).

    The generator's code lives in this package, so the child needs nothing of the main script, whose imports are
    most of a generator's start: a recipe imports our trainers (torch, transformers, peft, DeepSpeed: 9-14 s on the
    2-core development CPU), which the child then paid again while the learner loaded its models on the same cores.
    `needed` is true when what the child unpickles names `__main__` (a function or class of the user's script)."""
    main = sys.modules.get("__main__")
    if needed or main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__spec__", "__file__") if k in main.__dict__}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        main.__dict__.update(saved)
        if "__spec__" not in saved:
            del main.__spec__


def names_main_script(obj) -> bool:
    """Whether unpickling `obj` in a spawned process would need the parent's main script (`__main__`)."""
    return b"__main__" in bytes(ForkingPickler.dumps(obj))


class _Start:
    """`start` without `NOT_INHERITED` in the environment and without importing the parent's main script
    (`main_script_hidden`); the parent's environment and main module are unchanged after it (processes are started
    from the main thread only, see `local.py`)."""

    def start(self) -> None:
        saved = {k: os.environ.pop(k) for k in NOT_INHERITED if k in os.environ}
        try:
            with main_script_hidden(needed=names_main_script((self._target, self._args[0]))):
                super().start()
        finally:
            os.environ.update(saved)


class GeneratorProcess(_Start, SpawnProcess):
    """A spawned generator process: a fresh interpreter that imports what it needs."""


class ForkedGeneratorProcess(_Start, ForkServerProcess):
    """A generator process forked from the warm server (`prewarm.py`): its imports are done; it takes the learner's
    environment as it is at `start` (the server's is the one the learner had when the server started)."""

    def start(self) -> None:
        self._args = (*self._args[:3], generator_environ())
        super().start()


class ProcessLauncher:
    """Generators as processes of learner rank 0, with `multiprocessing` queues (the default launcher): forked from the
    warm server where `prewarm.prewarm_generators` started it, else spawned."""

    def __init__(self):
        self._forked = warm()
        self._ctx = mp.get_context("forkserver" if self._forked else "spawn")

    def queues(self):
        """(inbox, outbox) for one generator process."""
        return self._ctx.Queue(), self._ctx.Queue()

    def process(self, spec: GeneratorSpec, inbox, outbox):
        kind = ForkedGeneratorProcess if self._forked else GeneratorProcess
        return kind(target=generator_main, args=(spec, inbox, outbox), daemon=True,
                    name=f"async_rlhf-generator-{spec.generator_id}")

    def close(self) -> None:
        pass


def see_log(spec: GeneratorSpec) -> str:
    return f"\n(the generator's full output: {spec.log_path})" if spec.log_path else ""


def stop_process(p, timeout: float) -> None:
    """Wait up to `timeout` for `p` to exit, then SIGKILL it (a generator ignores SIGTERM)."""
    if p.pid is None:
        return
    p.join(timeout)
    if p.is_alive():
        p.kill()
        p.join(5.0)


def kill_all(processes: list) -> None:
    """SIGKILL every process of `processes` still running, and reap it."""
    for p in processes:
        if p.pid is not None and p.exitcode is None:
            p.kill()
            p.join(5.0)
