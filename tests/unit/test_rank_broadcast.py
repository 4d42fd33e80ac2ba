"""What rank 0 sends the other learner ranks each step, over a real 2-process gloo group: `broadcast_json` gives every
rank rank 0's message exactly (a step's rollouts with extreme log-probs, a failure's multi-line, non-ASCII text, a
message of megabytes), in order, as JSON (nothing is unpickled); `share_batch` gives every rank the step's batch, or
rank 0's failure raised with the same type and message. A batch with a non-finite log-prob is such a failure
(`check_logprobs_finite` on rank 0), so rank 1 never has to refuse it on its own."""

from __future__ import annotations

import dataclasses
import math
import multiprocessing as mp
import traceback

import pytest
import torch

from async_rlhf.errors import GeneratorFailed
from async_rlhf.pipeline.rank_share import broadcast_json, check_logprobs_finite, share_batch
from async_rlhf.errors import StageTimeout
from async_rlhf.types import Completion, RolloutBatch

BATCH = RolloutBatch(batch_id=3, generator_id=-1, policy_version=2, prompt_ids=[7, 1],
                     prompt_token_ids=[[5, 6], [9]],
                     completions=[[Completion([1, 2], [-0.5, -1e-300], "stop"), Completion([], [], "length")],
                                  [Completion([4], [-1e300], "length"), Completion([8, 8, 2], [-0.25, 0.0, -3.0],
                                                                                      "stop")]],
                     seconds=0.125, chunk=0, num_chunks=1)

# What the pipeline sends (a batch, or the failure that ends the run), then the edge cases of the encoding.
MESSAGES = [
    {"batch": dataclasses.asdict(BATCH)},
    {"failure": "GeneratorFailed",
     "message": "generator 0 (cpu) exited with code 1; restarts exhausted (3). Last error:\nOSError: é ✓ \x00"},
    {},
    {"big": list(range(300_000))},  # ~2 MB of JSON: the length is sent first and must not be truncated
]


def _rank(rank: int, init_file: str, results) -> None:
    try:
        torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
        cpu = torch.device("cpu")
        got = [broadcast_json(m if rank == 0 else None, cpu) for m in MESSAGES]
        shared = share_batch(BATCH if rank == 0 else None, None, cpu)
        raised = []
        for failure in (GeneratorFailed("generator 0 (cpu) exited; restarts exhausted (3)"),
                        StageTimeout("rollouts: batch 4 not ready within 1s")):
            try:
                share_batch(None, failure if rank == 0 else None, cpu)
            except (GeneratorFailed, StageTimeout) as exc:
                raised.append((type(exc).__name__, str(exc)))
        results.put((rank, got + [shared, raised]))
        torch.distributed.destroy_process_group()
    except BaseException:
        results.put((rank, traceback.format_exc()))


def test_every_rank_gets_rank_0s_message_exactly(tmp_path):
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
        assert isinstance(out[rank], list), out[rank]  # else the rank's traceback
        # dict equality, every value: -1e300 and -1e-300 survive, the batch's lists stay lists, the text is intact
        for sent, got in zip(MESSAGES, out[rank][:len(MESSAGES)], strict=True):
            assert got == sent
        shared, raised = out[rank][len(MESSAGES):]
        assert shared == BATCH  # the step's batch, rebuilt from its own serialisation
        # rank 0's failure leaves every rank's loop at the same step, with the same type and message
        assert raised == [("GeneratorFailed", "generator 0 (cpu) exited; restarts exhausted (3)"),
                          ("StageTimeout", "rollouts: batch 4 not ready within 1s")]


def test_a_batch_with_a_non_finite_log_prob_is_a_generator_failure_naming_where():
    bad = dataclasses.replace(BATCH, completions=[[Completion([1], [-0.5], "stop"), Completion([2], [-math.inf], "stop")],
                                                  BATCH.completions[1]])
    check_logprobs_finite(BATCH)
    with pytest.raises(GeneratorFailed, match=r"a generator: batch 3 \(policy version 2\) has a non-finite behaviour "
                                              r"log-prob -inf at prompt 7, completion 1, token 0"):
        check_logprobs_finite(bad)
