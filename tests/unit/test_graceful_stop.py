"""Once the trainer got SIGINT/SIGTERM, the generator pool restarts nothing (issue 23): a restart would start another
engine on the way out and use up one of `generator_max_restarts`. Ctrl-C reaches generators too; they ignore it
(`tests/integration/test_generator_process.py`). Rank 0's objects are real (`RolloutPipeline`, `GeneratorPool`); only
the dead generator process is a stand-in."""

import signal
import types

import pytest

from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.errors import GeneratorFailed
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.pipeline.rollout_pipeline import RolloutPipeline
from async_rlhf.trainers.base import AsyncTrainerBase
from async_rlhf.types import SamplingSettings

ARGS = types.SimpleNamespace(prompts_per_step=2, seed=0, max_staleness=1, sync_every=1, rollout_timeout=5.0,
                             streaming=False, generator_assignment="count")
RANK_0 = types.SimpleNamespace(is_main_process=True, num_processes=1)


class _DeadProcess:
    """A generator process that has exited (as if by a SIGINT it did not ignore)."""
    pid = None
    exitcode = 1

    def is_alive(self):
        return False


def test_a_stopping_run_restarts_no_generator(tmp_path):
    pool = GeneratorPool([GeneratorSpec(0, "transformers", str(tmp_path), "cpu", 0, 1)], on_rollouts=lambda batch: None,
                         start_timeout=60, weight_sync_timeout=60, max_restarts=3)
    try:
        pool.processes[0] = _DeadProcess()
        pipeline = RolloutPipeline(ARGS, [[5, 6], [7, 8]], "unused", RANK_0, total_steps=1,
                                   settings=SamplingSettings(max_new_tokens=2))
        pipeline.pool = pool
        trainer = types.SimpleNamespace(_stop_signal=0, pipeline=pipeline)
        AsyncTrainerBase._on_signal(trainer, signal.SIGINT, None)  # Ctrl-C: the trainer's handler, first signal
        assert trainer._stop_signal == signal.SIGINT
        with pytest.raises(GeneratorFailed, match="exited with code 1 while the run was stopping; not restarted"):
            pool.check()
        assert pool.restarts[0] == 0 and isinstance(pool.processes[0], _DeadProcess)  # no engine was started
    finally:
        pool.close(timeout=1)
