"""The generators' safetensors readers (copying and mapped): the same tensors as safetensors' own loader, and
nothing left behind.

A generator reloads weights every step for the whole run, so a few objects kept per tensor read add up:
safetensors 0.8's `safe_open(...).get_tensor` keeps two per tensor (about 56 bytes), which `benchmarks/soak.py`
showed as steady RSS growth in the generator process.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from async_rlhf.weight_sync.safetensors_io import iter_safetensors, map_safetensors


@pytest.fixture
def weights_file(tmp_path):
    state = {
        "model.embed_tokens.weight": torch.randn(10, 4),
        "lm_head.weight": torch.randn(3, 4).to(torch.bfloat16),
        "a.half": torch.randn(5).half(),
        "b.ids": torch.arange(7, dtype=torch.int64).reshape(7, 1),
        "c.mask": torch.tensor([True, False, True]),
        "d.scalar": torch.tensor(2.5),
        "e.empty": torch.zeros(0, 3),
    }
    path = str(tmp_path / "w.safetensors")
    save_file(state, path, metadata={"format": "pt"})
    return path


READERS = pytest.mark.parametrize("reader", [iter_safetensors, map_safetensors])


@READERS
def test_reads_what_safetensors_reads(weights_file, reader):
    want = load_file(weights_file)
    got = list(reader(weights_file))
    assert [n for n, _ in got] == sorted(want)  # name order, like safe_open(...).keys()
    for name, tensor in got:
        assert tensor.dtype == want[name].dtype and tensor.shape == want[name].shape, name
        assert torch.equal(tensor, want[name]), name


@READERS
def test_truncated_file_is_an_error(weights_file, reader):
    data = open(weights_file, "rb").read()
    with open(weights_file, "wb") as f:
        f.write(data[:-8])
    with pytest.raises(ValueError, match="truncated"):
        list(reader(weights_file))


def test_mapped_reader_copies_nothing_and_never_writes_the_file(weights_file):
    before = open(weights_file, "rb").read()
    tensors = dict(map_safetensors(weights_file))
    # every tensor is a view into one mapping of the file
    assert len({t.untyped_storage().data_ptr() for t in tensors.values() if t.numel()}) == 1
    tensors["model.embed_tokens.weight"].fill_(7.0)  # private mapping: the learner's file stays as written
    assert open(weights_file, "rb").read() == before


@READERS
def test_reading_leaves_nothing_behind(weights_file, reader):
    for _ in range(5):  # warm caches
        list(reader(weights_file))
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(200):
            for _ in reader(weights_file):
                pass
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = sum(d.count_diff for d in after.compare_to(before, "filename") if d.count_diff > 0)
    # 200 reads x 7 tensors: safetensors' get_tensor would keep about 2,800 objects here
    assert kept < 100, kept
