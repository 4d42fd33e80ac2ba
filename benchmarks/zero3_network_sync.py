"""ZeRO-3 learners on the network transport: what the learner is blocked for at a sync, what learner rank 0 holds,
and how long one version takes to reach a generator, the two ways (`weight_sync/partitions.py`):

  gather      `gather_full_state` on every rank (DeepSpeed's `GatheredParameters`, one parameter at a time), rank 0
              keeps the full CPU copy, and the send (`broadcast.send_packed`) goes from it: the way before
  partitions  `PartitionStore.take` on every rank (a local copy of its partitions), and the send assembles full
              tensors bucket by bucket as it goes (the way a ZeRO-3 run with weight_transport='network' syncs now)
  socket      the bound: the same bytes through one plain TCP socket on loopback

    torchrun --nproc_per_node 2 benchmarks/zero3_network_sync.py --size tiny --repeats 2

Two learner ranks partition a random Llama with DeepSpeed's own `zero.Init` (gloo, CPU); rank 0 sends to one
generator process that only receives (vote, packed buckets, a closing vote: `weight_broadcast.py`'s receiver).
Medians of --repeats rounds after a warm-up. "blocked" is rank 0's time in the learner's sync (every rank's in the
gather way), "send" the round to the generator (in a run it goes on a sender thread, beside training), "held" the
most bytes rank 0 held at once for the network, keeping (as the transport does) the version the generator has until
the next one is sent: two full states, or two versions' partitions plus one bucket being assembled.
On the 2-core machine the two learners and the generator share the cores, so the send also waits for CPU.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [ROOT, HERE]

from weight_broadcast import _network_receiver, socket_send_seconds  # noqa: E402  (the wire and its bound)
from weight_load import SIZES  # noqa: E402


def _receiver(meta: list, repeats: int, threads: int):
    """A generator process in a weight group of its own with rank 0: (process, rank 0's group)."""
    from async_rlhf.weight_sync import broadcast

    names = [n for n, _, _ in meta]
    dtypes = [str(d).removeprefix("torch.") for _, d, _ in meta]
    shapes = [list(s) for _, _, s in meta]
    sock = broadcast.listen("127.0.0.1")
    info = broadcast.GroupInfo(host="127.0.0.1", port=sock.getsockname()[1], rank=1, world_size=2, timeout=600.0,
                               prefix=broadcast.new_prefix())
    proc = mp.get_context("spawn").Process(target=_network_receiver, daemon=True,
                                           args=(info.to_dict(), names, dtypes, shapes, repeats, threads))
    proc.start()
    return proc, broadcast.WeightGroup(info, rank=0, listen_socket=sock)


def _send(group, tensors) -> None:
    from async_rlhf.weight_sync import broadcast

    group.vote(True)
    broadcast.send_packed(group, tensors, group.info.bucket_bytes)
    group.vote(True)  # the receiver has every byte


def measure(model, rank: int, repeats: int, threads: int) -> dict:
    import torch.distributed as dist

    from async_rlhf.weight_sync.gather import gather_full_state
    from async_rlhf.weight_sync.network import update_metadata
    from async_rlhf.weight_sync.partitions import PartitionStore

    out: dict = {}
    # the gather way: every rank gathers, rank 0 keeps the copy and sends from it
    blocked, send = [], []
    receiver = group = None
    previous = None  # the transport keeps the version the generator has until it has loaded the next one
    for r in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        state = gather_full_state(model, rank == 0)
        t1 = time.perf_counter()
        if rank == 0:
            if receiver is None:
                meta = [(n, t.dtype, list(t.shape)) for n, t in state.items()]
                receiver, group = _receiver(meta, repeats, threads)
            _send(group, list(state.values()))
            if r:
                blocked.append(t1 - t0)
                send.append(time.perf_counter() - t1)
            out["state_bytes"] = update_metadata(state)["num_bytes"]
            held = out["state_bytes"] * (2 if previous is not None else 1)
            out["gather_held"] = max(out.get("gather_held", 0), held)
            previous = state
    if rank == 0:
        receiver.join(60)
        group.close()
        out["gather"] = {"blocked": statistics.median(blocked), "send": statistics.median(send),
                         "held_bytes": out.pop("gather_held")}
        out["socket"] = socket_send_seconds(state, 1, repeats)
    del state, previous
    # the partitions way (the same retention: version r is released once r + 1 has been sent)
    store = PartitionStore.open(model, timeout=600.0)
    blocked, send = [], []
    receiver = group = None
    for r in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        state = store.take(r + 1)
        t1 = time.perf_counter()
        if rank == 0:
            if receiver is None:
                receiver, group = _receiver(state.meta, repeats, threads)
            _send(group, (t for _, t in state.items()))
            if r:
                blocked.append(t1 - t0)
                send.append(time.perf_counter() - t1)
            store.release(r + 1)  # the generator has r + 1: older versions go, on every rank
    if rank == 0:
        receiver.join(60)
        group.close()
        out["partitions"] = {"blocked": statistics.median(blocked), "send": statistics.median(send),
                             "held_bytes": store.held_bytes_peak}
    dist.barrier()
    store.close(wait=60.0)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each process")
    parser.add_argument("--json", default=None, help="also write the figures here (rank 0)")
    args = parser.parse_args(argv)
    import deepspeed
    import torch
    import torch.distributed as dist

    from async_rlhf.data.tiny_model import char_tokenizer, tiny_llama

    torch.set_num_threads(args.threads)
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hidden, layers, heads = SIZES[args.size]
    config = {"train_batch_size": world, "zero_optimization": {"stage": 3}}
    model = tiny_llama(char_tokenizer(), hidden_size=hidden, num_layers=layers, num_heads=heads, seed=0)
    deepspeed.zero.Init(module=model, config_dict_or_path=config)  # partitions it in place, as a run's engine does
    out = measure(model, rank, args.repeats, args.threads)
    if rank == 0:
        mb = out["state_bytes"] / 1e6
        print(f"ZeRO-3, {world} learner ranks, one generator; {args.size}: {mb:.1f} MB fp32; median of "
              f"{args.repeats} rounds; {os.cpu_count()} cores")
        print(f"{'way':<12}{'blocked s':>10}{'send s':>10}{'sync s':>10}{'x socket':>10}{'held MB':>10}")
        for way in ("gather", "partitions"):
            w = out[way]
            sync = w["blocked"] + w["send"]
            print(f"{way:<12}{w['blocked']:>10.3f}{w['send']:>10.3f}{sync:>10.3f}{sync / out['socket']:>10.2f}"
                  f"{w['held_bytes'] / 1e6:>10.1f}")
        print(f"{'socket':<12}{'':>10}{out['socket']:>10.3f}{out['socket']:>10.3f}{1.0:>10.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": args.size, "world_size": world, "repeats": args.repeats, **out}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
