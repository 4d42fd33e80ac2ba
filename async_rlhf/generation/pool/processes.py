"""How a local generator process is started and ended: the default launcher (spawned processes with
`multiprocessing` queues; `ray_launcher.RayLauncher` is the other) and the pool's bounded ways to stop them."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
from contextlib import contextmanager
from multiprocessing.context import SpawnProcess
from multiprocessing.reduction import ForkingPickler

from async_rlhf.generation.engine.worker import GeneratorSpec, generator_main

# Variables a generator process must not inherit: transformers prints "[INFO] Running in WANDB offline mode" at
# import wherever WANDB_MODE is "offline": once per generator on the console otherwise. Generators never log to
# wandb.
NOT_INHERITED = ("WANDB_MODE",)


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


class GeneratorProcess(SpawnProcess):
    """A spawned generator process whose environment lacks `NOT_INHERITED` and whose start does not import the
    parent's main script (`main_script_hidden`); the parent's environment and main module are unchanged after
    `start` (processes are started from the main thread only, see `local.py`)."""

    def start(self) -> None:
        saved = {k: os.environ.pop(k) for k in NOT_INHERITED if k in os.environ}
        try:
            with main_script_hidden(needed=names_main_script((self._target, self._args[0]))):
                super().start()
        finally:
            os.environ.update(saved)


class ProcessLauncher:
    """Generators as spawned processes of learner rank 0, with `multiprocessing` queues (the default launcher)."""

    def __init__(self):
        self._ctx = mp.get_context("spawn")

    def queues(self):
        """(inbox, outbox) for one generator process."""
        return self._ctx.Queue(), self._ctx.Queue()

    def process(self, spec: GeneratorSpec, inbox, outbox):
        return GeneratorProcess(target=generator_main, args=(spec, inbox, outbox), daemon=True,
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
