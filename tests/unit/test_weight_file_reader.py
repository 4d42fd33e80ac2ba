"""The generator's safetensors reader: the same tensors as safetensors' own loader, and nothing left behind.

A generator reloads weights every step for the whole run, so a few objects kept per tensor read add up:
safetensors 0.8's `safe_open(...).get_tensor` keeps two per tensor (about 56 bytes), which `benchmarks/soak.py`
showed as steady RSS growth in the generator process.
"""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from safetensors.torch import load_file, save_file

from async_rlhf.generation.vllm_worker_extension import iter_safetensors


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


def test_reads_what_safetensors_reads(weights_file):
    want = load_file(weights_file)
    got = list(iter_safetensors(weights_file))
    assert [n for n, _ in got] == sorted(want)  # name order, like safe_open(...).keys()
    for name, tensor in got:
        assert tensor.dtype == want[name].dtype and tensor.shape == want[name].shape, name
        assert torch.equal(tensor, want[name]), name


def test_truncated_file_is_an_error(weights_file):
    data = open(weights_file, "rb").read()
    with open(weights_file, "wb") as f:
        f.write(data[:-8])
    with pytest.raises(ValueError, match="truncated"):
        list(iter_safetensors(weights_file))


def test_reading_leaves_nothing_behind(weights_file):
    for _ in range(5):  # warm caches
        list(iter_safetensors(weights_file))
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for _ in range(200):
            for _ in iter_safetensors(weights_file):
                pass
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    kept = sum(d.count_diff for d in after.compare_to(before, "filename") if d.count_diff > 0)
    # 200 reads x 7 tensors: safetensors' get_tensor would keep about 2,800 objects here
    assert kept < 100, kept
