"""How a local generator process is started and ended: the default launcher (spawned processes with
`multiprocessing` queues; `ray_launcher.RayLauncher` is the other) and the pool's bounded ways to stop them."""

from __future__ import annotations

import multiprocessing as mp

from async_rlhf.generation.engine.worker import GeneratorSpec, generator_main


class ProcessLauncher:
    """Generators as spawned processes of learner rank 0, with `multiprocessing` queues (the default launcher)."""

    def __init__(self):
        self._ctx = mp.get_context("spawn")

    def queues(self):
        """(inbox, outbox) for one generator process."""
        return self._ctx.Queue(), self._ctx.Queue()

    def process(self, spec: GeneratorSpec, inbox, outbox):
        return self._ctx.Process(target=generator_main, args=(spec, inbox, outbox), daemon=True,
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
