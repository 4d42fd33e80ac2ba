"""ZeRO-3 learners on the network transport (`weight_sync/partitions.py`): each rank keeps its own partitions of a
version, rank 0 assembles full tensors bucket by bucket while it sends them. Two learner ranks here are two threads,
each with its own copy of a tiny model partitioned the way DeepSpeed's `zero.Init` leaves it (rank r holds elements
[r*p, (r+1)*p) of each flattened parameter, p = ceil(numel / 2), zero-padded), joined by a real gloo group on
loopback. The real DeepSpeed layout is checked by tests/integration/test_deepspeed_learners.py (slow)."""

from __future__ import annotations

import copy
import math
import threading
import time

import pytest
import torch

from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
from async_rlhf.weight_sync import broadcast
from async_rlhf.weight_sync.partitions import PartitionedState, PartitionStore

WORLD = 2
BUCKET = 64 << 10


def partition(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    """`model` as DeepSpeed's ZeRO-3 leaves it on `rank` of WORLD: each parameter's data gone, its partition kept."""
    for i, p in enumerate(model.parameters()):
        numel, size = p.numel(), math.ceil(p.numel() / WORLD)
        padded = torch.zeros(size * WORLD, dtype=p.dtype)
        padded[:numel] = p.data.reshape(-1)
        p.ds_tensor = padded[rank * size:(rank + 1) * size].clone()
        p.ds_numel, p.ds_shape, p.ds_id = numel, tuple(p.shape), i
        p.data = torch.empty(0, dtype=p.dtype)
    return model


@pytest.fixture
def stores():
    model = tiny_llama(char_tokenizer(), hidden_size=64, num_layers=6)
    full = {k: v.clone() for k, v in model.state_dict().items()}
    sock = broadcast.listen("127.0.0.1")
    info = broadcast.GroupInfo(host="127.0.0.1", port=sock.getsockname()[1], rank=1, world_size=WORLD,
                               timeout=30.0, prefix=broadcast.new_prefix(), bucket_bytes=BUCKET)
    members = {}
    joining = threading.Thread(target=lambda: members.setdefault(1, broadcast.WeightGroup(info, rank=1)))
    joining.start()
    members[0] = broadcast.WeightGroup(info, rank=0, listen_socket=sock)
    joining.join(30)
    made = [PartitionStore(partition(copy.deepcopy(model), r), members[r], r, WORLD, timeout=30.0,
                           bucket_bytes=BUCKET) for r in range(WORLD)]
    yield full, made
    for s in reversed(made):
        s.close()


def _shift(store: PartitionStore, by: float) -> None:
    with torch.no_grad():
        for p in store.params:
            p.ds_tensor.add_(by)


def test_rank0_assembles_each_version_exactly_and_never_holds_it_whole(stores):
    full, (rank0, rank1) = stores
    state = rank0.take(1)
    assert rank1.take(1) is None and isinstance(state, PartitionedState)
    assert [n for n, _, _ in state.meta] == list(full)  # the state dict's names and order, without a collective
    got = dict(state.items())
    assert list(got) == list(full)
    for name, tensor in full.items():
        assert torch.equal(got[name], tensor), name
    whole = sum(t.numel() * t.element_size() for t in full.values())
    # its half of every parameter, plus one bucket of full tensors and the two halves they came from
    assert rank0.held_bytes_peak < 0.75 * whole, (rank0.held_bytes_peak, whole)


def test_a_lazy_stream_goes_out_in_the_buckets_a_receiver_plans_from_the_metadata(stores):
    full, (rank0, rank1) = stores
    state = rank0.take(1)
    rank1.take(1)
    names = [n for n, _, _ in state.meta]
    dtypes = [str(d).removeprefix("torch.") for _, d, _ in state.meta]
    shapes = [s for _, _, s in state.meta]
    sock = broadcast.listen("127.0.0.1")
    info = broadcast.GroupInfo(host="127.0.0.1", port=sock.getsockname()[1], rank=1, world_size=2, timeout=30.0,
                               prefix=broadcast.new_prefix(), bucket_bytes=BUCKET)
    received = {}

    def generator():
        member = broadcast.WeightGroup(info, rank=1)
        for bucket in broadcast.receive_packed(member, names, dtypes, shapes, BUCKET):
            received.update((n, t.clone()) for n, t in bucket)
        member.close()

    thread = threading.Thread(target=generator)
    thread.start()
    sender = broadcast.WeightGroup(info, rank=0, listen_socket=sock)
    broadcast.send_packed(sender, (t for _, t in state.items()), BUCKET)
    thread.join(30)
    sender.close()
    assert list(received) == list(full)
    assert all(torch.equal(received[n], full[n]) for n in full)


def test_a_send_waits_for_a_rank_that_takes_the_version_late_and_release_reaches_every_rank(stores):
    full, (rank0, rank1) = stores
    rank0.take(1)
    rank1.take(1)
    _shift(rank0, 1.0)
    state = rank0.take(2)
    late = threading.Timer(0.5, lambda: (_shift(rank1, 1.0), rank1.take(2)))
    late.start()
    got = dict(state.items())  # rank 1 serves v2 once its own training loop has copied it
    late.join()
    for name, tensor in full.items():
        if tensor.is_floating_point() and name in dict(rank0._model.named_parameters(remove_duplicate=False)):
            assert torch.equal(got[name], tensor + 1.0), name
    rank0.release(2)
    deadline = time.monotonic() + 10
    while set(rank1._versions) != {2} and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(rank0._versions) == set(rank1._versions) == {2}


def test_a_send_abandoned_part_way_leaves_no_rank_inside_a_collective(stores):
    full, (rank0, rank1) = stores
    state = rank0.take(1)
    rank1.take(1)
    items = state.items()
    next(items)  # the generator failed after its first tensor
    items.close()
    got = dict(state.items())  # the next send works: rank 1 finished the abandoned round with rank 0
    assert all(torch.equal(got[n], full[n]) for n in full)
    assert rank0.broken is None and rank1.broken is None


def test_a_parameter_that_is_not_a_zero3_partition_is_refused_by_name():
    model = tiny_llama(char_tokenizer(), hidden_size=64, num_layers=6)
    with pytest.raises(ValueError, match=r"model\.embed_tokens\.weight: not a ZeRO-3 partitioned parameter"):
        PartitionStore(model, group=None, rank=0, world_size=WORLD, timeout=1.0, bucket_bytes=BUCKET)
