"""Seconds per weight sync, by phase: shared memory into a local generator, the same file loaded by a vLLM server
over its weight routes (remote generators), and the wire time of a gloo broadcast, against a plain tensor copy.

    python benchmarks/weight_broadcast.py                      # tiny and ~100M-parameter Llamas (a few minutes)
    python benchmarks/weight_broadcast.py --sizes tiny --repeats 5

Phases, as the pipeline logs them (median of --repeats syncs after a warm-up; GB/s = state-dict bytes / seconds):
  gather      learner rank 0: `gather_full_state` (the CPU copy of the weights, taken before the optimizer steps)
  shm write   `ShmWeightTransport.publish`: safetensors into /dev/shm (blocks the learner)
  shm load    the vLLM generator loads that file (`VLLMBackend.load_weights`: vLLM's native weight-transfer calls
              with our "async_rlhf_shm" backend, which maps the file and feeds vLLM's layerwise reload)
  http load   a vLLM server (`python -m async_rlhf.generation.serve`) loading the shm file through its weight
              routes, driven by the trainer's own `HTTPGeneratorPool` (vLLM's trainer-side engine, four HTTP calls)
  http sync   publish -> the server's acknowledgement, end to end
  bc send     the gloo broadcast of the same tensors to a process that only receives: the wire alone (the broadcast
              transport is no longer used by the trainer; kept as the cross-host CPU reference)
  copy        one `tensor.copy_` of the same number of bytes: the memory-bandwidth floor
The table has one line per path: transfer is "shm write", load "shm load" or "http load", sync the whole update as
a generator sees it (gather + write + load, or gather + write + http sync), x copy that sync time over the copy
time, and blocked what the learner waits for (gather + write: the load runs in the generator). Below the table,
the broadcast's wire time, the shm load split into the engine's start / update / finish calls, and whether the
generator's log-probs equal the learner's after a sync (see weight_load.py). The shm numbers come from
benchmarks/weight_load.py (one subprocess per size, its own engine); the http ones from a real server on loopback.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from weight_load import SIZES, median_seconds  # noqa: E402  (the shm half of this benchmark lives there)


def build(size: str):
    from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama

    hidden, layers, heads = SIZES[size]
    tokenizer = char_tokenizer()
    return tiny_llama(tokenizer, hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0), tokenizer


def _receive_only(info: dict, names: list, shapes: list, repeats: int, threads: int) -> None:
    import torch

    from async_rlhf.types import WeightUpdate
    from async_rlhf.weight_sync.broadcast import GroupInfo, WeightGroup, receive_weights

    torch.set_num_threads(threads)
    group = WeightGroup(GroupInfo.from_dict(info), rank=1)
    update = WeightUpdate(version=0, transport="broadcast", names=names, dtypes=["float32"] * len(names),
                          shapes=shapes)
    for _ in range(repeats + 1):
        for _ in receive_weights(group, update):
            pass
    group.close()


def broadcast_send_seconds(state: dict, repeats: int, threads: int) -> float:
    """The wire alone: rank 0 broadcasts `state` to a spawned process that receives and drops it."""
    from async_rlhf.weight_sync.broadcast import BroadcastWeightTransport

    transport = BroadcastWeightTransport("gloo", timeout=600)
    transport.listen("127.0.0.1")
    proc = mp.get_context("spawn").Process(target=_receive_only, args=(
        transport.member_info(1, 2).to_dict(), list(state), [list(t.shape) for t in state.values()], repeats,
        threads), daemon=True)
    proc.start()
    try:
        transport.open(2)
        version = [0]

        def send():
            version[0] += 1
            transport.publish(state, version[0])
            transport.wait_sent(version[0], 600)

        return median_seconds(send, repeats)
    finally:
        proc.join(60)
        transport.close()


def start_server(model_dir: str, threads: int) -> tuple[subprocess.Popen, str]:
    from async_rlhf.generation.serve import READY_LINE

    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "async_rlhf.generation.serve", "--model", model_dir, "--port",
                             "0", "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    for line in proc.stdout:
        if line.startswith(READY_LINE):
            threading_drain(proc)
            return proc, line[len(READY_LINE):].split()[0]
    raise RuntimeError(f"generator server exited with {proc.wait()} before it was ready")


def threading_drain(proc: subprocess.Popen) -> None:
    """Keep reading the server's log so a full pipe never blocks it."""
    import threading

    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def measure_http(size: str, repeats: int, threads: int) -> dict:
    import torch

    from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool
    from async_rlhf.weight_sync import ShmWeightTransport, gather_full_state

    torch.set_num_threads(threads)
    model, tokenizer = build(size)
    state = gather_full_state(model, True)
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    row = {"size": size, "params": sum(t.numel() for t in state.values()), "mb": num_bytes / 1e6,
           "gather": median_seconds(lambda: gather_full_state(model, True), repeats),
           "bc_send": broadcast_send_seconds(state, repeats, threads)}
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        server, address = start_server(model_dir, threads)
        transport = ShmWeightTransport("/dev/shm")
        pool = HTTPGeneratorPool([address], lambda batch: None, transport, model_dir, 0, 600, 600, 600)
        try:
            pool.start()
            ends, loads = [], []
            for version in range(1, repeats + 2):  # the first one is the warm-up
                t0 = time.perf_counter()
                pool.send_weights(transport.publish(state, version))
                while pool.acks.min_loaded_version() < version:
                    pool.check()
                    time.sleep(0.0005)
                transport.release(version)
                if version > 1:
                    ends.append(time.perf_counter() - t0)
                    loads.append(pool.acks.load_seconds[-1])
            row["http_load"], row["http_sync"] = statistics.median(loads), statistics.median(ends)
        finally:
            pool.close()
            transport.close()
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(60)
    return row


def measure_shm(size: str, repeats: int, threads: int) -> dict:
    cmd = [sys.executable, os.path.join(HERE, "weight_load.py"), "--one", size, "--repeats", str(repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": ROOT})
    lines = [line for line in out.stdout.splitlines() if line.startswith("ROW ")]
    if out.returncode != 0 or not lines:
        sys.exit(f"{size}: weight_load.py failed\n{out.stderr[-3000:]}")
    r = json.loads(lines[-1][4:])
    return {"shm_write": r["save"], "shm_load": r["vllm"], "copy": r["copy"], "equal": r["equal"],
            **{f"shm_{k}": r[k] for k in ("start", "update", "finish", "reload")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "100M"], choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch/OMP threads of every measuring process")
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        row = measure_http(size, args.repeats, args.threads)
        row.update(measure_shm(size, args.repeats, args.threads))
        rows.append(row)
        print("ROW " + json.dumps(row), flush=True)

    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, threads {args.threads}, load "
          f"average {os.getloadavg()[0]:.1f}, median of {args.repeats}")
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """One line per size and path: seconds and GB/s per phase; `blocked` is what the learner waits for."""
    print(f"{'size':>5} {'MB':>6} {'path':>9} | {'gather s':>9} {'GB/s':>5} | {'transfer s':>10} {'GB/s':>5} | "
          f"{'load s':>7} {'GB/s':>5} | {'sync s':>7} {'GB/s':>5} {'x copy':>6} | {'blocked s':>9}")
    for r in rows:
        gb = r["mb"] / 1e3
        blocked = r["gather"] + r["shm_write"]  # the load runs in the generator while the learner trains
        lines = [("shm", r["shm_write"], r["shm_load"], blocked + r["shm_load"], blocked),
                 ("http", r["shm_write"], r["http_load"], blocked + r["http_sync"], blocked)]
        for name, transfer, load, total, blocked in lines:
            print(f"{r['size']:>5} {r['mb']:>6.1f} {name:>9} | {r['gather']:>9.4f} {gb / r['gather']:>5.2f} | "
                  f"{transfer:>10.4f} {gb / transfer:>5.2f} | {load:>7.4f} {gb / load:>5.2f} | {total:>7.4f} "
                  f"{gb / total:>5.2f} {total / r['copy']:>6.1f} | {blocked:>9.4f}")
        print(f"{r['size']:>5} {r['mb']:>6.1f} {'copy':>9} | {'':>15} | {r['copy']:>10.4f} {gb / r['copy']:>5.2f} |")
        print(f"{r['size']:>5} gloo broadcast wire alone (no consumer): {r['bc_send']:.4f} s "
              f"({gb / r['bc_send']:.2f} GB/s)")
    for r in rows:
        print(f"{r['size']}: shm load = engine start {r['shm_start']:.4f} s + update {r['shm_update']:.4f} s + finish "
              f"{r['shm_finish']:.4f} s (the previous reload_weights path: {r['shm_reload']:.4f} s); generator "
              f"log-probs equal the learner's after a sync: {r['equal']}")

if __name__ == "__main__":
    main()
