"""A weight publish that fails on rank 0 (shm_dir full: OSError) ends the run like a generator failure (issue 23):
`GeneratorFailed` from the next `batch_for_step`, which rank 0 shares with every rank and `train()` turns into the
failure checkpoint; raising it on rank 0 alone, inside `after_optimizer_step`, would leave the other ranks waiting
in a collective and skip the checkpoint. The pipeline is real; its pool and transport are stand-ins."""

import errno
import os
import types

import pytest
import torch

from async_rlhf import AsyncOnlineDPOConfig
from async_rlhf.errors import GeneratorFailed
from async_rlhf.generation.pool.scheduling import FixedGenerators
from async_rlhf.pipeline.generator_pool import AckTracker
from async_rlhf.pipeline.rollout_pipeline import RolloutPipeline
from async_rlhf.types import SamplingSettings
from async_rlhf.weight_sync.shm import ShmWeightTransport
from async_rlhf.weight_sync.transport import WholeStates

RANK_0 = types.SimpleNamespace(is_main_process=True, num_processes=1)


class _Pool:
    num_generators = 1
    start_seconds = start_wait_seconds = 0.0

    def __init__(self):
        self.restarts, self.places = {0: 0}, {}
        self.acks = AckTracker([0], 0, 60)
        self.sent = []

    def send_weights(self, update):
        self.sent.append(update)

    def send_request(self, generator_id, request):
        pass

    def active_generators(self):
        return [0]

    def check(self):
        pass

    def start(self):
        pass

    def close(self, timeout=20.0):
        pass


class _FullShm(WholeStates):
    name = "shm"
    device = "cpu"

    def publish(self, state, version):
        raise OSError(errno.ENOSPC, "No space left on device", "/dev/shm/async_rlhf-weights-x")

    def release(self, version):
        pass

    def stats(self):
        return {}

    def close(self):
        pass


def test_a_failed_weight_publish_fails_the_next_step_like_a_generator_failure(tmp_path):
    args = AsyncOnlineDPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_staleness=1,
                                rollout_timeout=5.0, generation_mode="batch", generator_assignment="count")
    pipeline = RolloutPipeline(args, [[5, 6], [7, 8], [5, 7], [6, 8]], "unused", RANK_0, total_steps=4,
                               settings=SamplingSettings(max_new_tokens=2),
                               make_pool=lambda on_rollouts, version: (_FullShm(), _Pool(), FixedGenerators()))
    pipeline.start()
    pipeline.after_optimizer_step(torch.nn.Linear(2, 2), 1)  # returns: the other ranks must not be left waiting
    assert pipeline.pool.sent == [] and pipeline.queued_version == 0
    with pytest.raises(GeneratorFailed, match=r"weight sync: publishing weights v1 failed \(OSError: \[Errno 28\]"):
        pipeline.batch_for_step(1)  # at once, not after rollout_timeout
    pipeline.after_optimizer_step(torch.nn.Linear(2, 2), 2)  # nothing more is published after a failure
    with pytest.raises(GeneratorFailed, match="publishing weights v1 failed"):
        pipeline.batch_for_step(2)


def test_publish_refuses_a_file_that_would_not_fit_and_leaves_no_partial_file(tmp_path, monkeypatch):
    from async_rlhf.weight_sync import shm

    transport = ShmWeightTransport(str(tmp_path))
    try:
        state = {"w": torch.zeros(1000)}
        real = shm.shutil.disk_usage
        monkeypatch.setattr(shm.shutil, "disk_usage", lambda p: real(p)._replace(free=100))
        with pytest.raises(OSError, match="weights v1 need") as refused:
            transport.publish(state, 1)
        assert refused.value.errno == errno.ENOSPC and os.listdir(transport.dir) == ["owner.lock"]
        monkeypatch.setattr(shm.shutil, "disk_usage", real)

        def save_half_then_fail(tensors, path):  # the device fills up while the file is written
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(shm, "save_file", save_half_then_fail)
        with pytest.raises(OSError, match="No space left on device"):
            transport.publish(state, 2)
        assert sorted(os.listdir(transport.dir)) == ["owner.lock"]  # no .tmp left to fill the RAM disk
    finally:
        transport.close()
