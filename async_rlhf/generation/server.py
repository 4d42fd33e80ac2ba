"""A generator that runs on its own (another node, another container): one sampling engine behind a TCP port.

    python -m async_rlhf.generation.server --model PATH --port 8765                      # loopback only
    ASYNC_RLHF_GENERATOR_TOKEN=$(cat token) python -m async_rlhf.generation.server \\
        --model PATH --host 0.0.0.0 --port 8765 --allow_remote --device cuda              # reachable from other nodes

The trainer connects with `generator_servers=["host:8765"]` and then drives it exactly like a generator process
it spawned: generation requests in, version-tagged rollouts out, weights by broadcast over a torch.distributed
group that the trainer opens and this server joins (`weight_sync/broadcast.py`). `--model` only has to describe
the same architecture: the trainer pushes its own weights as soon as it connects.

Guarantees (the same as `generation/worker.py`'s, so the staleness queue and the pipeline need nothing new):
* one trainer session at a time; its messages are served strictly in order, so weights sent before a request are
  loaded before that request is sampled, and every rollout carries the version loaded when it was sampled;
* a session ends when the trainer says bye, disconnects or sends something invalid, or on any error (reported to
  the trainer first); the server then leaves the weight group and waits for the next trainer;
* a second trainer that connects meanwhile is told the server is busy.

Security: the server binds to 127.0.0.1 unless `--host` says otherwise, and a non-loopback address needs both
`--allow_remote` and a shared token (`ASYNC_RLHF_GENERATOR_TOKEN`, or `--token`, which other users can read in the
process table). With a token every frame must carry it (compared in constant time), otherwise the connection is
refused with an error and closed. Frames are JSON (`wire.py`); nothing from the network is unpickled, and before
authentication a frame may be at most 64 KiB. The token is not encryption: use a private network or a tunnel.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback

from async_rlhf.generation import wire

logger = logging.getLogger("async_rlhf.generation.server")
TOKEN_ENV = wire.TOKEN_ENV
READY_LINE = "async_rlhf generator server ready on"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, allow_remote: bool, token: str) -> None:
    """Refuse an exposed server that was not asked for explicitly, or that anyone could drive."""
    if is_loopback(host):
        return
    if not allow_remote:
        raise SystemExit(f"--host {host}: not a loopback address; pass --allow_remote to accept connections from "
                         "other machines (and set a shared token)")
    if not token:
        raise SystemExit(f"--host {host} --allow_remote needs a shared token: set {TOKEN_ENV} (or --token)")


class GeneratorServer:
    def __init__(self, backend, token: str, model: str, hello_timeout: float = 30.0):
        self.backend = backend
        self.token = token
        self.model = model
        self.hello_timeout = hello_timeout
        self._session = threading.Lock()
        self._stop = threading.Event()
        self.sessions = 0

    # ---- connections ------------------------------------------------------------------------------------------
    def serve(self, listener: socket.socket) -> None:
        listener.settimeout(1.0)
        while not self._stop.is_set():
            try:
                conn, peer = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn, peer), daemon=True,
                             name=f"async_rlhf-server-{peer[0]}:{peer[1]}").start()

    def stop(self) -> None:
        self._stop.set()

    def _authorized(self, frame: dict) -> bool:
        if not self.token:
            return True
        sent = frame.get("token")
        return isinstance(sent, str) and hmac.compare_digest(sent.encode(), self.token.encode())

    def _handle(self, conn: socket.socket, peer) -> None:
        wire.keep_alive(conn)  # notice a trainer whose machine vanished
        try:
            conn.settimeout(self.hello_timeout)
            hello = wire.recv_frame(conn, wire.HELLO_MAX_BYTES)
            if hello["kind"] != "hello" or not self._authorized(hello):
                logger.warning("refused %s:%s: wrong or missing token", peer[0], peer[1])
                self._refuse(conn, "unauthorized: wrong or missing token (set ASYNC_RLHF_GENERATOR_TOKEN to the "
                                   "server's token)")
                return
            if hello.get("protocol") != wire.PROTOCOL:
                self._refuse(conn, f"protocol {hello.get('protocol')!r} not supported (server speaks {wire.PROTOCOL})")
                return
            if not self._session.acquire(blocking=False):
                self._refuse(conn, "busy: this server is serving another trainer")
                return
            try:
                conn.settimeout(None)
                self.sessions += 1
                logger.info("session %d: trainer %s:%s connected", self.sessions, peer[0], peer[1])
                self._session_loop(conn)
            finally:
                self._leave_group()
                self._session.release()
                logger.info("session %d ended", self.sessions)
        except (OSError, wire.ProtocolError) as exc:
            logger.warning("connection from %s:%s dropped: %s", peer[0], peer[1], exc)
        finally:
            conn.close()

    @staticmethod
    def _refuse(conn: socket.socket, message: str) -> None:
        try:
            wire.send_frame(conn, {"kind": "error", "message": message})
        except OSError:
            pass

    # ---- one trainer session -------------------------------------------------------------------------------
    def _session_loop(self, conn: socket.socket) -> None:
        b = self.backend
        device = str(getattr(b, "device", "cpu")).split(":")[0]
        wire.send_frame(conn, {"kind": "ready", "backend": b.name, "device": device,
                               "num_workers": b.num_workers, "model": self.model})
        inbox: queue.Queue = queue.Queue()  # a reader thread drains the socket, so the trainer never blocks on it
        reader = threading.Thread(target=self._read, args=(conn, inbox), daemon=True)
        reader.start()
        version = None  # nothing loaded in this session yet: the trainer's first message is its weights
        while True:
            msg = inbox.get()
            if isinstance(msg, BaseException):
                if not isinstance(msg, wire.ConnectionClosed):
                    self._refuse(conn, f"{type(msg).__name__}: {msg}")
                return
            kind = msg["kind"]
            try:
                if kind == "bye":
                    return
                if kind == "join_group":
                    from async_rlhf.weight_sync.broadcast import GroupInfo

                    info = GroupInfo.from_dict(msg.get("group"))
                    b.join_weight_group(info)
                    wire.send_frame(conn, {"kind": "group_joined"})
                elif kind == "weights":
                    update = wire.decode_update(msg)
                    t0 = time.perf_counter()
                    b.load_weights(update)
                    version = update.version
                    wire.send_frame(conn, {"kind": "weights_loaded", "version": version,
                                           "seconds": time.perf_counter() - t0})
                elif kind == "generate":
                    request = wire.decode_request(msg)
                    if version is None:
                        raise RuntimeError("generate before any weights were loaded in this session")
                    t0 = time.perf_counter()
                    completions = b.generate(request.prompt_token_ids, request.settings)
                    from async_rlhf.types import RolloutBatch

                    wire.send_frame(conn, wire.encode_rollouts(RolloutBatch(
                        batch_id=request.batch_id, generator_id=0, policy_version=version,
                        prompt_ids=request.prompt_ids, prompt_token_ids=[], completions=completions,
                        seconds=time.perf_counter() - t0, chunk=request.chunk, num_chunks=request.num_chunks)))
                else:
                    raise wire.ProtocolError(f"unknown message kind {kind!r}")
            except wire.ConnectionClosed:
                return
            except Exception as exc:
                logger.error("session failed on %r: %s", kind, exc)
                self._refuse(conn, f"{kind}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
                return

    def _read(self, conn: socket.socket, inbox: queue.Queue) -> None:
        while True:
            try:
                frame = wire.recv_frame(conn)
            except BaseException as exc:  # closed, malformed or reset: the session loop ends on it
                inbox.put(exc if isinstance(exc, (wire.ConnectionClosed, wire.ProtocolError)) else
                          wire.ConnectionClosed(str(exc)))
                return
            if not self._authorized(frame):
                inbox.put(wire.ProtocolError("unauthorized: a frame without the session's token"))
                return
            inbox.put(frame)

    def _leave_group(self) -> None:
        try:
            self.backend.leave_weight_group()
        except Exception as exc:
            logger.warning("leaving the weight group: %s", exc)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m async_rlhf.generation.server", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model directory (config, tokenizer, weights) or hub id")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    p.add_argument("--port", type=int, default=8765, help="TCP port (0: any free port, printed on the ready line)")
    p.add_argument("--token", default=None, help=f"shared token (prefer the {TOKEN_ENV} environment variable)")
    p.add_argument("--allow_remote", action="store_true", help="allow binding a non-loopback address")
    p.add_argument("--backend", default="vllm", choices=["vllm", "transformers"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", help="engine dtype ('auto', 'float32', 'bfloat16', ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads on CPU (default: all cores)")
    p.add_argument("--max_model_len", type=int, default=None)
    p.add_argument("--gpu_memory_utilization", type=float, default=0.9)
    p.add_argument("--tensor_parallel_size", type=int, default=1)
    p.add_argument("--kv_cache_memory_mb", type=int, default=None, help="vLLM KV cache size on CPU (default 1 GiB)")
    p.add_argument("--hello_timeout", type=float, default=30.0, help="seconds a new connection has to say hello")
    return p.parse_args(argv)


def build_backend(args: argparse.Namespace):
    import torch

    from async_rlhf.generation import load_backend

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    if args.backend == "transformers":
        dtype = "float32" if args.dtype == "auto" else args.dtype
        return load_backend("transformers", args.model, device=device, seed=args.seed, dtype=dtype)
    kwargs = dict(dtype=args.dtype, max_model_len=args.max_model_len, tensor_parallel_size=args.tensor_parallel_size,
                  gpu_memory_utilization=args.gpu_memory_utilization)
    if args.kv_cache_memory_mb:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_mb << 20
    return load_backend("vllm", args.model, device=device, seed=args.seed, **kwargs)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = os.environ.get(TOKEN_ENV) or args.token or ""
    check_bind(args.host, args.allow_remote, token)  # before anything slow, so a bad command fails at once
    if args.threads and args.device != "cuda":
        os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    listener = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((args.host, args.port))  # a taken port fails now, not after the engine has started
    listener.listen(16)  # trainers that connect while the engine starts wait in the backlog
    t0 = time.perf_counter()
    backend = build_backend(args)
    server = GeneratorServer(backend, token, args.model, args.hello_timeout)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: server.stop())
    host, port = listener.getsockname()[:2]
    print(f"{READY_LINE} {host}:{port} ({backend.name}, engine start {time.perf_counter() - t0:.1f}s, "
          f"token {'required' if token else 'not required'})", flush=True)
    try:
        server.serve(listener)
    finally:
        listener.close()
        backend.close()


if __name__ == "__main__":
    main()
