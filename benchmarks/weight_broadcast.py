"""Seconds per weight sync, by phase: shared memory into a local generator, the same file loaded by a vLLM server
over its weight routes, and the network transport (a gloo group per generator, vLLM's weight routes), against a
plain tensor copy and against the same bytes through plain sockets.

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
  copy        one `tensor.copy_` of the same number of bytes: the memory-bandwidth floor
Network transport (below the table):
  wire        `weight_sync.broadcast`'s round to 1 and 2 generator processes that only receive: one group each, sent
              in parallel threads (as the pools do), vote + packed buckets, until every receiver has all bytes
  socket      the bound, measured in the same run: the same bytes through plain TCP sockets on loopback, one
              connection per receiver in parallel, until every receiver has them (target: wire <= 1.5x socket)
  net sync    a vLLM server loading the version over the network (`weight_transport='network'`: our
              async_rlhf_gloo backend through vLLM's weight routes), publish -> acknowledgement, end to end
  blocked     what the learner waits for on the network path: gather + publish (which only keeps a reference)
The table has one line per path: transfer is "shm write", load "shm load" or "http load", sync the whole update as
a generator sees it (gather + write + load, or gather + write + http sync), x copy that sync time over the copy
time, and blocked what the learner waits for (gather + write: the load runs in the generator). Below the table,
the network figures, the shm load split into the engine's start / update / finish calls, and whether the
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


def _network_receiver(info: dict, names: list, dtypes: list, shapes: list, repeats: int, threads: int) -> None:
    """A generator's end of one weight group that receives every round and drops it (the wire alone)."""
    import torch

    from async_rlhf.weight_sync import broadcast

    torch.set_num_threads(threads)
    info = broadcast.GroupInfo.from_dict(info)
    group = broadcast.WeightGroup(info, rank=1)
    for _ in range(repeats + 1):
        group.vote(True)
        for _ in broadcast.receive_packed(group, names, dtypes, shapes, info.bucket_bytes):
            pass
        group.vote(True)  # "all bytes are here": the sender's clock stops at this barrier
    group.close()


def network_send_seconds(state: dict, receivers: int, repeats: int, threads: int) -> float:
    """Seconds per sync of the network transport's wire to `receivers` generators: one group each (as the pools
    form them), the sends in parallel threads, each round vote + packed buckets + a closing barrier."""
    import threading

    from async_rlhf.weight_sync import broadcast

    names, tensors = list(state), list(state.values())
    dtypes = [str(t.dtype).removeprefix("torch.") for t in tensors]
    shapes = [list(t.shape) for t in tensors]
    ctx = mp.get_context("spawn")
    groups, procs, socks = [None] * receivers, [], []
    for r in range(receivers):
        sock = broadcast.listen("127.0.0.1")
        info = broadcast.GroupInfo(host="127.0.0.1", port=sock.getsockname()[1], rank=1, world_size=2, timeout=600.0,
                                   prefix=broadcast.new_prefix())
        socks.append((sock, info))
        procs.append(ctx.Process(target=_network_receiver, args=(info.to_dict(), names, dtypes, shapes, repeats,
                                                                  threads), daemon=True))
        procs[-1].start()

    def form(r):
        groups[r] = broadcast.WeightGroup(socks[r][1], rank=0, listen_socket=socks[r][0])

    def one(r):
        groups[r].vote(True)
        broadcast.send_packed(groups[r], tensors, socks[r][1].bucket_bytes)
        groups[r].vote(True)

    def parallel(fn):
        workers = [threading.Thread(target=fn, args=(r,)) for r in range(receivers)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    try:
        parallel(form)
        return median_seconds(lambda: parallel(one), repeats)
    finally:
        for p in procs:
            p.join(60)
        for g in groups:
            if g is not None:
                g.close()


def _socket_receiver(port: int, num_bytes: int, repeats: int) -> None:
    import socket

    buffer = bytearray(num_bytes)
    with socket.create_connection(("127.0.0.1", port)) as conn:
        view = memoryview(buffer)
        for _ in range(repeats + 1):
            got = 0
            while got < num_bytes:
                got += conn.recv_into(view[got:], num_bytes - got)
            conn.sendall(b"k")


def socket_send_seconds(state: dict, receivers: int, repeats: int) -> float:
    """The bound: the same bytes through plain TCP sockets on loopback, one connection per receiver in parallel
    threads, each round ending when every receiver has all bytes (its one-byte answer)."""
    import socket
    import threading

    views = [memoryview(t.contiguous().view(-1).view(__import__("torch").uint8).numpy()) for t in state.values()]
    num_bytes = sum(v.nbytes for v in views)
    ctx = mp.get_context("spawn")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(receivers)
        procs = [ctx.Process(target=_socket_receiver, args=(server.getsockname()[1], num_bytes, repeats), daemon=True)
                 for _ in range(receivers)]
        for p in procs:
            p.start()
        conns = [server.accept()[0] for _ in range(receivers)]

    def one(conn):
        for v in views:
            conn.sendall(v)
        assert conn.recv(1) == b"k"

    def parallel():
        workers = [threading.Thread(target=one, args=(c,)) for c in conns]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    try:
        return median_seconds(parallel, repeats)
    finally:
        for c in conns:
            c.close()
        for p in procs:
            p.join(60)


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
    from async_rlhf.weight_sync import gather_full_state
    from async_rlhf.weight_sync.network import StateTransport

    torch.set_num_threads(threads)
    model, tokenizer = build(size)
    state = gather_full_state(model, True)
    num_bytes = sum(t.numel() * t.element_size() for t in state.values())
    row = {"size": size, "params": sum(t.numel() for t in state.values()), "mb": num_bytes / 1e6,
           "gather": median_seconds(lambda: gather_full_state(model, True), repeats)}
    for receivers in (1, 2):
        row[f"net_wire_{receivers}"] = network_send_seconds(state, receivers, repeats, threads)
        row[f"socket_{receivers}"] = socket_send_seconds(state, receivers, repeats)
    with tempfile.TemporaryDirectory() as model_dir:
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        server, address = start_server(model_dir, threads)
        try:
            for mode in ("shm", "network"):  # the same server, driven by a pool of each kind in turn
                transport = StateTransport("/dev/shm")
                pool = HTTPGeneratorPool([address], lambda batch: None, transport, model_dir, 0, 600, 600, 600,
                                         weight_transport=mode)
                try:
                    pool.start()
                    ends, loads, publish = [], [], []
                    for version in range(1, repeats + 2):  # the first one is the warm-up
                        t0 = time.perf_counter()
                        update = transport.publish(state, version)
                        t1 = time.perf_counter()
                        pool.send_weights(update)
                        while pool.acks.min_loaded_version() < version:
                            pool.check()
                            time.sleep(0.0005)
                        transport.release(version)
                        if version > 1:
                            ends.append(time.perf_counter() - t0)
                            loads.append(pool.acks.load_seconds[-1])
                            publish.append(t1 - t0)
                    key = "http" if mode == "shm" else "net"
                    row[f"{key}_load"], row[f"{key}_sync"] = statistics.median(loads), statistics.median(ends)
                    row[f"{key}_publish"] = statistics.median(publish)
                finally:
                    pool.close()
                    transport.close()
        finally:
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["tiny", "100M"], choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch/OMP threads of every measuring process")
    args = parser.parse_args(argv)
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
        for n in (1, 2):
            wire, bound = r[f"net_wire_{n}"], r[f"socket_{n}"]
            print(f"{r['size']:>5} network wire to {n} generator(s): {wire:.4f} s per sync ({n * gb / wire:.2f} GB/s "
                  f"out of rank 0) vs the same bytes through plain sockets {bound:.4f} s: {wire / bound:.2f}x")
        print(f"{r['size']:>5} network into a vLLM server: sync {r['net_sync']:.4f} s (load {r['net_load']:.4f} s); "
              f"learner blocked {r['gather'] + r['net_publish']:.4f} s per sync = gather {r['gather']:.4f} s + "
              f"publish {r['net_publish']:.4f} s (the send runs on the pool's thread)")
    for r in rows:
        print(f"{r['size']}: shm load = engine start {r['shm_start']:.4f} s + update {r['shm_update']:.4f} s + finish "
              f"{r['shm_finish']:.4f} s (the previous reload_weights path: {r['shm_reload']:.4f} s); generator "
              f"log-probs equal the learner's after a sync: {r['equal']}")

if __name__ == "__main__":
    main()
