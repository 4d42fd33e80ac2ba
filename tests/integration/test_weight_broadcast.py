"""The broadcast weight transport over gloo between two real processes: learner rank 0 (this process) publishes
two versions, a generator process (the transformers backend) joins the group, receives and loads them, and its
weights then equal what was sent, bit for bit. And a group that never forms fails within its timeout, naming the
stage. (The same code runs over NCCL on GPUs: tests/gpu/test_nccl_broadcast.py.)"""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from async_rlhf.types import WeightUpdate
from async_rlhf.weight_sync.broadcast import BroadcastWeightTransport, GroupInfo, WeightBroadcastError


def _generator(model_dir: str, info: dict, updates: list[dict], out: str) -> None:
    torch.set_num_threads(1)
    from async_rlhf.generation.engine.hf_backend import HFBackend

    backend = HFBackend(model_dir)
    backend.join_weight_group(GroupInfo.from_dict(info))
    for i, update in enumerate(updates):
        backend.load_weights(WeightUpdate(**update))
        save_file({k: v.contiguous() for k, v in backend.model.state_dict().items()}, f"{out}.{i}")
    backend.close()


def _perturbed(state: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g) for k, v in state.items()}


def test_gloo_broadcast_loads_every_version_exactly(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    versions = [_perturbed(state, 1), _perturbed(state, 2)]
    transport = BroadcastWeightTransport("gloo", timeout=120)
    transport.listen("127.0.0.1")
    try:
        # the metadata is known before publishing (names, dtypes, shapes), so the generator gets every update up
        # front, as it would through its FIFO inbox
        updates = [dict(version=v + 1, transport="broadcast", names=list(s), dtypes=["float32"] * len(s),
                        shapes=[list(t.shape) for t in s.values()]) for v, s in enumerate(versions)]
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=_generator, args=(tiny_model_dir, transport.member_info(1, 2).to_dict(), updates,
                                                    str(tmp_path / "loaded")), daemon=True)
        proc.start()
        transport.open(world_size=2)
        for v, s in enumerate(versions):
            update = transport.publish(s, v + 1)
            assert update.names == updates[v]["names"] and update.shapes == updates[v]["shapes"]
            assert update.num_bytes == sum(t.numel() * 4 for t in s.values())
        transport.wait_sent(2, timeout=120)
        proc.join(120)
        assert proc.exitcode == 0
    finally:
        transport.close()
    for v, sent in enumerate(versions):
        loaded = load_file(str(tmp_path / f"loaded.{v}"))
        assert loaded.keys() == sent.keys()
        for name in sent:
            assert torch.equal(loaded[name], sent[name]), (v, name)
    assert transport.sent_versions == [1, 2] and transport.send_seconds > 0


def test_group_that_never_forms_fails_within_its_timeout():
    transport = BroadcastWeightTransport("gloo", timeout=3)
    transport.listen("127.0.0.1")
    t0 = time.monotonic()
    try:
        with pytest.raises(WeightBroadcastError, match="weight sync: the broadcast group .* did not form within 3s"):
            transport.open(world_size=2)  # nobody joins
    finally:
        transport.close()
    assert time.monotonic() - t0 < 30
