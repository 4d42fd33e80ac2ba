"""What serving a generator over HTTP costs: start-up and per-request time of a vLLM server driven by the trainer's
`HTTPGeneratorPool`, against the in-process `VLLMBackend` our generator processes run, on the same tiny model.

    python benchmarks/generator_http.py                  # tiny Llama, 8 prompts x 2 samples x 8 tokens, 10 repeats
    python benchmarks/generator_http.py --prompts 1 --repeats 20

start      in-process: `VLLMBackend(...)` constructed; server: `python -m async_rlhf.generation.serve` spawned ->
           its ready line (a fresh Python process importing vLLM, plus the API process and the engine-core process)
request    one `GenerationRequest` (same prompts, settings and seeds), median of --repeats after a warm-up:
           in-process `backend.generate`; HTTP `pool.send_request` -> the pool's `on_rollouts` (one POST per prompt,
           all in flight at once). The difference is the HTTP, JSON, API-process and engine-core hops.
Samples are compared too: the same seeds give the same tokens on both paths.
"""

from __future__ import annotations

import argparse
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    args = parser.parse_args()

    from async_rlhf.data.tiny_model import save_tiny_model
    from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool
    from async_rlhf.generation.serve import READY_LINE
    from async_rlhf.generation.engine.vllm_backend import VLLMBackend
    from async_rlhf.types import GenerationRequest, SamplingSettings

    settings = SamplingSettings(max_new_tokens=args.max_new_tokens, temperature=1.0, n=2, seed=11)
    prompts = [[2] + [40 + (i + j) % 20 for j in range(6)] for i in range(args.prompts)]
    request = GenerationRequest(0, list(range(args.prompts)), prompts, settings)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(os.path.join(tmp, "model"))

        t0 = time.perf_counter()
        backend = VLLMBackend(model_dir, dtype="float32", kv_cache_memory_bytes=64 << 20)
        local_start = time.perf_counter() - t0
        local_out = backend.generate(prompts, settings)
        local = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            backend.generate(prompts, settings)
            local.append(time.perf_counter() - t0)
        backend.close()

        t0 = time.perf_counter()
        cmd = [sys.executable, "-m", "async_rlhf.generation.serve", "--model", model_dir, "--port", "0", "--dtype",
               "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)]
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
        address = None
        for line in server.stdout:
            if line.startswith(READY_LINE):
                address = line[len(READY_LINE):].split()[0]
                break
        if address is None:
            sys.exit(f"server exited with {server.wait()} before it was ready")
        server_start = time.perf_counter() - t0
        import threading

        threading.Thread(target=lambda: [None for _ in server.stdout], daemon=True).start()
        done: queue.Queue = queue.Queue()
        pool = HTTPGeneratorPool([address], done.put, None, model_dir, 0, 120, 120, 120)
        try:
            t0 = time.perf_counter()
            pool.start()
            pool_start = time.perf_counter() - t0

            def one():
                t0 = time.perf_counter()
                pool.send_request(0, request)
                while True:
                    try:
                        batch = done.get(timeout=0.001)
                        return batch, time.perf_counter() - t0
                    except queue.Empty:
                        pool.check()

            http_out = one()[0].completions
            remote = [one()[1] for _ in range(args.repeats)]
        finally:
            pool.close()
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)

    same = [[c.token_ids for c in p] for p in local_out] == [[c.token_ids for c in p] for p in http_out]
    lm, rm = statistics.median(local), statistics.median(remote)
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS')}, load average {os.getloadavg()[0]:.1f}")
    print(f"start:   in-process VLLMBackend {local_start:.1f} s | server to ready line {server_start:.1f} s "
          f"(+ pool.start {pool_start:.2f} s)")
    print(f"request: {args.prompts} prompts x {settings.n} samples x {settings.max_new_tokens} tokens, median of "
          f"{args.repeats}: in-process {lm * 1e3:.1f} ms | HTTP {rm * 1e3:.1f} ms | overhead {(rm - lm) * 1e3:.1f} ms "
          f"({(rm - lm) / args.prompts * 1e3:.1f} ms per prompt)")
    print(f"same samples on both paths: {same}")


if __name__ == "__main__":
    main()
