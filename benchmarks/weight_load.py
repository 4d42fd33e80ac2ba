"""How long a weight update takes through /dev/shm, per model size, for both generator backends.

    python benchmarks/weight_load.py            # tiny, ~10M and ~100M-parameter Llamas (about 2-3 min on 2 cores)
    python benchmarks/weight_load.py --sizes tiny --threads 2

Columns (median of --repeats runs after one warm-up; GB/s = state-dict bytes / seconds):
  save       learner side: `safetensors.torch.save_file(model.state_dict())` into /dev/shm
  vllm       `VLLMBackend.load_weights`: safe_open (memory-mapped) -> worker `reload_weights` -> prefix-cache reset
  vllm_file  the same reload fed from `safetensors.torch.load_file` (whole file read first), for comparison
  hf         `HFBackend.load_weights`: load_file + `load_state_dict`
  copy       one `tensor.copy_` of the same number of bytes: the memory-bandwidth floor

Each size runs in its own subprocess (vLLM reads its environment once per process, so one engine per process)
with OMP_NUM_THREADS=--threads. On a busy machine more torch threads than free cores makes every parallel
`copy_` wait for a descheduled thread: on our shared 2-core box at load average 5, a 42 MB `load_state_dict`
took 1.1 s with 2 threads and 0.015 s with 1. Models are random-init Llamas built from a config (no hub) with the char tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SIZES = {  # name: (hidden, layers, heads); intermediate = 4 * hidden, head size 32 or 64 (vLLM CPU attention)
    "tiny": (64, 2, 2),
    "10M": (256, 10, 4),
    "100M": (768, 11, 12),
}


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up: first-touch page faults and lazy initialisation are not what we measure
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def load_via_load_file(worker, path: str) -> None:
    """Runs inside the vLLM worker (collective_rpc): the non-mmap variant of the extension's loader."""
    from safetensors.torch import load_file

    worker.reload_weights(weights_iterator=iter(load_file(path).items()))


def measure(size: str, repeats: int) -> dict:
    import torch
    from safetensors.torch import save_file

    from async_rlhf.generation.hf_backend import HFBackend
    from async_rlhf.generation.vllm_backend import VLLMBackend
    from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama
    from async_rlhf.types import WeightUpdate

    hidden, layers, heads = SIZES[size]
    tokenizer = char_tokenizer()
    model = tiny_llama(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0)
    state = model.state_dict()
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    shm_path = f"/dev/shm/async_rlhf_bench_{os.getpid()}.safetensors"
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        vllm = VLLMBackend(model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20)
        hf = HFBackend(model_dir)
        try:
            save_s = median_seconds(lambda: save_file(state, shm_path), repeats)
            update = WeightUpdate(version=1, transport="shm", path=shm_path, num_bytes=num_bytes)
            rpc = vllm.llm.collective_rpc
            row = dict(
                size=size,
                params=sum(t.numel() for t in state.values()),
                mb=num_bytes / 1e6,
                save=save_s,
                vllm=median_seconds(lambda: vllm.load_weights(update), repeats),
                vllm_file=median_seconds(lambda: rpc(load_via_load_file, args=(shm_path,)), repeats),
                hf=median_seconds(lambda: hf.load_weights(update), repeats),
            )
        finally:
            vllm.close()
            os.unlink(shm_path)
    src, dst = torch.ones(num_bytes, dtype=torch.uint8), torch.empty(num_bytes, dtype=torch.uint8)
    row["copy"] = median_seconds(lambda: dst.copy_(src), max(repeats, 5))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each measuring process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one size, print a JSON row
    args = parser.parse_args()
    if args.one:
        print("ROW " + json.dumps(measure(args.one, args.repeats)), flush=True)
        return

    rows = []
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--one", size, "--repeats", str(args.repeats)]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [line for line in out.stdout.splitlines() if line.startswith("ROW ")]
        if out.returncode != 0 or not lines:
            sys.exit(f"{size}: benchmark subprocess failed\n{out.stderr[-3000:]}")
        rows.append(json.loads(lines[-1][4:]))

    cols = ["save", "vllm", "vllm_file", "hf", "copy"]
    print(f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={args.threads}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'size':>5} {'params':>11} {'MB':>7} " + " ".join(f"{c + ' s':>11} {'GB/s':>6}" for c in cols))
    for r in rows:
        cells = " ".join(f"{r[c]:>11.4f} {r['mb'] / 1e3 / r[c]:>6.2f}" for c in cols)
        print(f"{r['size']:>5} {r['params']:>11,} {r['mb']:>7.1f} {cells}")


if __name__ == "__main__":
    main()
