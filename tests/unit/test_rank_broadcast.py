"""What rank 0 sends the other learner ranks each step, over a real 2-process gloo group: the step's rollouts as
JSON (exactly, extreme log-probs included; nothing unpickled), or the failure that ends the run, raised on every
rank with the same type and message. A batch with a non-finite log-prob is such a failure: rank 0 refuses it, and
every rank raises the same error (rank 1 never gets to refuse it in `from_dict` on its own)."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import traceback
from types import SimpleNamespace

import torch

from async_rlhf.generation.pool_protocol import GeneratorFailed
from async_rlhf.pipeline import RolloutPipeline
from async_rlhf.staleness_queue import StalenessQueue
from async_rlhf.types import Completion, RolloutBatch

BATCH = RolloutBatch(batch_id=3, generator_id=-1, policy_version=2, prompt_ids=[7, 1],
                     prompt_token_ids=[[5, 6], [9]],
                     completions=[[Completion([1, 2], [-0.5, -1e-300], "stop"), Completion([], [], "length")],
                                  [Completion([4], [-1e300], "length"), Completion([8, 8, 2], [-0.25, 0.0, -3.0],
                                                                                      "stop")]],
                     seconds=0.125, chunk=0, num_chunks=1)
NONFINITE = dataclasses.replace(BATCH, batch_id=5, policy_version=4, completions=[[Completion([4], [-math.inf], "length")] * 2] * 2)


class _HealthyPool:
    def check(self):
        pass


class _FailingPool:
    def check(self):
        raise GeneratorFailed("generator 0 (cpu) exited with code 1; restarts exhausted (3). Last error:\nOSError: x")


def _pipeline(rank: int, batch: RolloutBatch | None) -> RolloutPipeline:
    """A pipeline with only what `batch_for_step` touches: no generators, no model."""
    p = RolloutPipeline.__new__(RolloutPipeline)
    p.is_main = rank == 0
    p.accelerator = SimpleNamespace(num_processes=2, device=torch.device("cpu"))
    p.args = SimpleNamespace(rollout_timeout=30.0)
    p.queue = StalenessQueue(max_staleness=1)
    p.total_steps = 0
    p._dispatch = lambda: None  # no generators to send to
    p.timers, p.gen_tokens, p.gen_seconds, p.regenerated = {"wait": 0.0}, 0, 0.0, 0
    p.pool = _FailingPool() if batch is None else _HealthyPool()
    if rank == 0 and batch is not None:
        p.queue.put(batch)
    return p


def _rank(rank: int, init_file: str, results) -> None:
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        got = _pipeline(rank, BATCH).batch_for_step(3)
        outcome = {"batch": got}
        try:
            _pipeline(rank, None).batch_for_step(4)
            outcome["failure"] = None
        except GeneratorFailed as exc:
            outcome["failure"] = str(exc)
        try:
            _pipeline(rank, NONFINITE).batch_for_step(5)
            outcome["nonfinite"] = None
        except GeneratorFailed as exc:
            outcome["nonfinite"] = str(exc)
        results.put((rank, outcome))
        torch.distributed.destroy_process_group()
    except BaseException:
        results.put((rank, {"error": traceback.format_exc()}))


def test_rollouts_and_failures_reach_every_rank(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "init"), results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        out = dict(results.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    for rank in (0, 1):
        assert "error" not in out[rank], out[rank]["error"]
        assert out[rank]["batch"] == BATCH  # dataclass equality: every field, every log-prob (-inf, 1e-300)
        assert out[rank]["failure"].startswith("generator 0 (cpu) exited with code 1; restarts exhausted (3)")
        assert out[rank]["failure"].endswith("OSError: x")
        assert out[rank]["nonfinite"].startswith("a generator: batch 5 (policy version 4) has a non-finite behaviour "
                                                 "log-prob -inf at prompt 7, completion 0, token 0")
