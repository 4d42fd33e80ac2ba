"""How long a weight update takes through /dev/shm, per model size, for both generator backends.

    python benchmarks/weight_load.py            # tiny, ~10M and ~100M-parameter Llamas (about 2-3 min on 2 cores)
    python benchmarks/weight_load.py --sizes tiny --threads 2

Columns (median of --repeats runs after one warm-up; GB/s = state-dict bytes / seconds):
  save       learner side: `safetensors.torch.save_file(model.state_dict())` into /dev/shm
  vllm       `VLLMBackend.load_weights`: header check -> vLLM's native start/update/finish_weight_update with our
             "async_rlhf_shm" backend (the file memory-mapped, views into vLLM's layerwise reload) -> prefix reset
  start, update, finish   the three engine calls of `vllm`, timed one by one (update: the weight loaders copy the
             file's bytes into re-created layers and each layer is re-processed as soon as it is complete;
             finish: the attention layers and the rest)
  reload     the previous path, for comparison: our copying reader -> the worker's `reload_weights`
  hf         `HFBackend.load_weights`: our copying reader + `load_state_dict`
  copy       one `tensor.copy_` of the same number of bytes: the memory-bandwidth floor
Each row also checks that the generator computes what the learner computes after a sync: a perturbed policy is
loaded through `vllm` and its greedy log-probs must equal the transformers forward's (`equal`, atol 1e-4).

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


def median_seconds(fn, repeats: int, warm_up: bool = True) -> float:
    if warm_up:
        fn()  # first-touch page faults and lazy initialisation are not what we measure
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def load_via_reload(worker, path: str) -> None:
    """Runs inside the vLLM worker (collective_rpc): the path `VLLMBackend` took before the weight-transfer engine."""
    from async_rlhf.weight_sync.safetensors_io import iter_safetensors

    worker.reload_weights(weights_iterator=iter_safetensors(path))


def engine_phases(vllm, path: str, repeats: int) -> dict:
    """Median seconds of each native engine call (the `vllm` column without the header check and prefix reset)."""
    from async_rlhf.generation.engine.vllm_backend import LLMClient
    from async_rlhf.weight_sync.safetensors_io import read_header

    client, names = LLMClient(vllm.llm), sorted(read_header(path)[0])
    times = {"start": [], "update": [], "finish": []}
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        client.start_weight_update()
        t1 = time.perf_counter()
        client.update_weights({"path": path, "version": 1, "names": names})
        t2 = time.perf_counter()
        client.finish_weight_update("1")
        t3 = time.perf_counter()
        if i:  # the first is the warm-up
            for k, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(dt)
    return {k: statistics.median(v) for k, v in times.items()}


def generator_equals_learner(vllm, model, path: str) -> bool:
    """Load a perturbed policy through the native path; the generator's greedy log-probs must be the learner's."""
    import torch
    from safetensors.torch import save_file

    from async_rlhf.types import SamplingSettings, WeightUpdate

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path)
    vllm.load_weights(WeightUpdate(version=2, transport="shm", path=path))
    prompt = [2, 40, 41, 42, 43]
    (completion,), = vllm.generate([prompt], SamplingSettings(max_new_tokens=8, temperature=0.0, n=1))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1 : -1].float()
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]
    return vllm.weight_version == "2" and torch.allclose(torch.tensor(completion.logprobs), expected, atol=1e-4)


def measure(size: str, repeats: int) -> dict:
    import torch
    from safetensors.torch import save_file

    from async_rlhf.generation.engine.hf_backend import HFBackend
    from async_rlhf.generation.engine.vllm_backend import VLLMBackend
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
                **engine_phases(vllm, shm_path, repeats),
                reload=median_seconds(lambda: rpc(load_via_reload, args=(shm_path,)), repeats),
                hf=median_seconds(lambda: hf.load_weights(update), repeats),
            )
            row["equal"] = generator_equals_learner(vllm, model, shm_path)
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

    cols = ["save", "vllm", "start", "update", "finish", "reload", "hf", "copy"]
    print(f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={args.threads}, load average {os.getloadavg()[0]:.1f}")
    print(f"{'size':>5} {'params':>11} {'MB':>7} " + " ".join(f"{c + ' s':>11} {'GB/s':>6}" for c in cols))
    for r in rows:
        cells = " ".join(f"{r[c]:>11.4f} {r['mb'] / 1e3 / r[c]:>6.2f}" for c in cols)
        print(f"{r['size']:>5} {r['params']:>11,} {r['mb']:>7.1f} {cells}  equal={r['equal']}")


if __name__ == "__main__":
    main()
