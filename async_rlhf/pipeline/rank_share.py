"""What learner ranks share about a step: rank 0's batch (or its failure) on every rank, as JSON over the default process
group, and the check that a batch's numbers are fit to train before it is shared.

Only rank 0 holds generators; every other rank receives each step's `RolloutBatch` from it (`pipeline/rollout_pipeline.py`). A failure
on rank 0 (a generator lost, a stage timed out, a reward function that raised) is raised on every rank with the same
type and message, so that all ranks leave the training loop at the same step.
"""

from __future__ import annotations

import json

import torch

from async_rlhf.errors import GeneratorFailed
from async_rlhf.errors import RewardError
from async_rlhf.errors import StageTimeout
from async_rlhf.types import RolloutBatch

FAILURES = {cls.__name__: cls for cls in (GeneratorFailed, StageTimeout, RewardError)}


def share_batch(batch: RolloutBatch | None, failure: Exception | None, device) -> RolloutBatch:
    """Rank 0's batch on every rank, or rank 0's failure (one of `FAILURES`, same message) raised on
    every rank, so that all ranks leave the training loop at the same step. Other ranks pass (None, None)."""
    message = None
    if torch.distributed.get_rank() == 0:
        message = ({"failure": type(failure).__name__, "message": str(failure)} if failure is not None
                   else {"batch": batch.to_dict()})
    message = broadcast_json(message, device)
    if "failure" in message:
        if failure is not None:
            raise failure
        raise FAILURES.get(message["failure"], StageTimeout)(message["message"])
    return RolloutBatch.from_dict(message["batch"])


def check_logprobs_finite(batch: RolloutBatch) -> None:
    """A sampled token has a finite behaviour log-prob; a NaN/inf one means the generator's numerics are broken. The
    batch is refused on rank 0 as a generator failure (raised on every rank, checkpoint saved) instead of reaching the
    loss, the other ranks (whose `from_dict` would refuse it) or a checkpoint."""
    bad = batch.first_nonfinite_logprob()
    if bad is not None:
        p, i, t, value = bad
        who = f"generator {batch.generator_id}" if batch.generator_id >= 0 else "a generator"  # -1: merged chunks
        raise GeneratorFailed(f"{who}: batch {batch.batch_id} (policy version "
                              f"{batch.policy_version}) has a non-finite behaviour log-prob {value} at prompt "
                              f"{batch.prompt_ids[p]}, completion {i}, token {t}; check the generator's dtype/backend")


def broadcast_json(message: dict | None, device) -> dict:
    """Rank 0's `message` on every rank, sent as JSON bytes over the default group: learner ranks may sit on other
    machines, and nothing received from the network is unpickled (`broadcast_object_list` would unpickle)."""
    is_src = torch.distributed.get_rank() == 0
    if is_src:
        data = torch.frombuffer(bytearray(json.dumps(message, allow_nan=False).encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.long, device=device)
    else:
        size = torch.zeros(1, dtype=torch.long, device=device)
    torch.distributed.broadcast(size, src=0)
    if not is_src:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    torch.distributed.broadcast(data, src=0)
    return json.loads(data.cpu().numpy().tobytes())
