"""Generators that are vLLM servers started on their own (`python -m async_rlhf.generation.serve`), driven over
HTTP. Lives on learner rank 0 and implements `pipeline/generator_pool.GeneratorPoolProtocol`, so the pipeline, the staleness
queue and the admission rule work unchanged.

Threads: the pool owns one thread running one asyncio event loop; every HTTP call and all per-server state live
there. The main thread only schedules work onto it (`send_request`, `send_weights`: they never block a training
step) and reads the recorded failures and acknowledgements (`check`). Finished rollouts are handed to `on_rollouts`
from the loop thread, one call at a time. A weight update's blocking HTTP round trip runs on a daemon thread of
its own while the loop awaits it, so a hung server can delay nothing else and never delays the interpreter's exit.

Requests: each prompt of a request is one `POST /inference/v1/generate` (token ids in, tokens, behaviour log-probs and
per-token weight versions out; n samples, seed `settings.seed + p*n` like the local vLLM backend, so the same request
gives the same samples); all prompts of a request, and all requests to a server, are in flight at once. A request's
rollouts are delivered as soon as all its prompts are back, tagged with the oldest version of any of its tokens.

Weights and versions, per server: `send_weights(v)` closes the server's gate at once (in the loop, in the order of
the calls), so any request sent later waits and is sampled with weights >= v. The update drives vLLM's weight routes
through vLLM's trainer-side engine, records the acknowledgement and opens the gate. Which engine, per server, is
decided at start (`config.checks.choose_transport`, config `weight_transport`): the pool writes a probe file
into `shm_dir` and asks the server whether it reads it (`POST /async_rlhf/weight_probe`); a server that does gets the
shm file (`async_rlhf_shm`'s trainer engine), one that does not (another host, a private /dev/shm) the network: a
group of its own with learner rank 0, formed at start through the token-protected `/init_weight_transfer_engine`
route, and per version vLLM's `/update_weights` while rank 0 broadcasts (`weight_sync.network.NetworkSender`).
With `weight_load="drain"` it first waits for the server's in-flight
requests to finish, so every sample has one version. With "in_flight" it loads at once: `/pause?mode=keep` freezes
the running requests in the engine, the weights load, `/reset_prefix_cache?reset_running_requests=true` makes the
running requests recompute their context with the new weights (as the local streaming generator does), and
`/resume` lets them continue; their later tokens carry the new version (vLLM's spans), so the staleness bound
applies to each rollout's oldest token.

Start: every server must answer `/health` within `start_timeout` (a refused token fails at once, naming the
server), serve a context of at least `min_model_len`, and load the trainer's starting policy when resuming (version
> 0) or when a previous run left other weights loaded (its weight version is not "default"); otherwise it serves
`--model`, which must be the trainer's starting policy.

Failures: any exception in the loop's work (HTTP errors, timeouts, bad JSON, non-finite log-probs, and anything
unexpected) is recorded against its server, and `check` raises it as `GeneratorFailed` naming the server; an update
not acknowledged within `weight_sync_timeout` is `StageTimeout` (`AckTracker`). Every HTTP call has a timeout
(`request_timeout` for sampling, `weight_sync_timeout` for weights). Remote servers are never restarted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from async_rlhf.config.checks import base_url, choose_transport
from async_rlhf.errors import GeneratorFailed, StageTimeout, WeightTransportError
from async_rlhf.generation.pool import http_client
from async_rlhf.generation.pool.http_client import ServerError, Unauthorized, WeightSyncClient
from async_rlhf.pipeline.generator_pool import AckTracker
from async_rlhf.types import GenerationRequest, RolloutBatch, WeightUpdate
from async_rlhf.weight_sync.network import PROBE_ROUTE, NetworkSender, for_transport

logger = logging.getLogger(__name__)


@dataclass
class _Server:
    """One server's state. Touched only on the loop thread (except `address` and `url`)."""

    gid: int
    address: str
    url: str
    model: str = ""
    version: int = 0  # the weights it has loaded
    in_flight: int = 0
    updates_pending: int = 0
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # set: requests may go
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set: no request in flight
    update_lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # FIFO: updates in the order sent
    engine: object = None  # vLLM trainer-side weight-transfer engine (shm), or a network.NetworkSender (network)
    client: object = None  # its WeightSyncClient (pause/resume/reset for in-flight loads)
    transport: str = "shm"  # "shm" | "network", chosen at start


class HTTPGeneratorPool:
    def __init__(self, addresses: list[str], on_rollouts: Callable[[RolloutBatch], None], transport, model_dir: str,
                 initial_version: int, start_timeout: float, weight_sync_timeout: float, request_timeout: float,
                 token: str = "", min_model_len: int = 0, weight_load: str = "drain", weight_transport: str = "auto",
                 network: dict | None = None):
        self.addresses = list(addresses)
        self.urls = [base_url(a) for a in self.addresses]
        self.on_rollouts = on_rollouts
        self.transport = transport  # network.StateTransport: shm files and/or states kept for the network
        self.weight_transport = weight_transport  # config: auto | shm | network
        self.network = dict(network or {})  # NetworkSender options: host, allow_remote, backend
        self.model_dir = model_dir
        self.initial_version = initial_version
        self.start_timeout = start_timeout
        self.weight_sync_timeout = weight_sync_timeout
        self.request_timeout = request_timeout
        self.token = token
        self.min_model_len = min_model_len
        self.weight_load = weight_load
        self.num_generators = len(self.addresses)
        self.acks = AckTracker(list(range(self.num_generators)), initial_version, weight_sync_timeout,
                               describe=self.describe)
        self.restarts = {g: 0 for g in range(self.num_generators)}  # never restarted: kept for the run summary
        self.places: dict[int, dict] = {}  # server -> {device, where, weights}, once started
        self.start_seconds = 0.0
        self.start_wait_seconds = 0.0
        self._servers: list[_Server] = []
        self._failed: dict[int, str] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._session = None
        self._tasks: set[asyncio.Future] = set()

    def describe(self, gid: int) -> str:
        return f"generator server {gid} ({self.addresses[gid]})"

    # ---- lifecycle (main thread) ---------------------------------------------------------------------------
    def start(self) -> None:
        t0 = time.monotonic()
        self._loop = asyncio.new_event_loop()
        self._loop.set_exception_handler(lambda loop, ctx: self._fail(-1, f"event loop: {ctx.get('message')} "
                                                                          f"{ctx.get('exception')!r}"))
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="async_rlhf-http-pool")
        self._thread.start()
        future = asyncio.run_coroutine_threadsafe(self._start(t0 + self.start_timeout), self._loop)
        done, _ = concurrent.futures.wait([future], self.start_timeout + 60.0)  # _start's own deadline comes first
        if not done:
            future.cancel()
            raise StageTimeout(f"generator start: generator servers {self.addresses} not ready within "
                               f"generator_start_timeout={self.start_timeout:.0f}s")
        future.result()  # raises what `_start` raised
        self.start_seconds = self.start_wait_seconds = time.monotonic() - t0

    def close(self, timeout: float = 20.0) -> None:
        """Let the weight updates already sent finish (at most `timeout`), then cancel everything and stop."""
        if self._loop is None:
            return
        deadline = time.monotonic() + timeout
        while self.acks.waiting() and not self._failed and time.monotonic() < deadline:
            time.sleep(0.05)

        async def shutdown():
            for task in list(self._tasks):
                task.cancel()
            if self._session is not None:
                await self._session.close()

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self._loop).result(max(1.0, deadline - time.monotonic()))
        except (TimeoutError, RuntimeError) as exc:
            logger.warning("http pool: shutdown did not finish cleanly: %r", exc)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5.0)
        for server in self._servers:
            if server.transport == "network" and server.engine is not None:
                server.engine.close()
        if not self._thread.is_alive():
            self._loop.close()
        self._loop = None

    def begin_stop(self) -> None:
        """Nothing to do: remote servers are never restarted by the trainer."""

    def check(self) -> None:
        """Raise if a server failed or a weight update is overdue. Main thread."""
        with self._lock:
            failed = dict(self._failed)
        for gid, reason in sorted(failed.items()):
            who = self.describe(gid) if gid >= 0 else "generator servers"
            raise GeneratorFailed(f"{who} failed: {reason}\nRemote servers are not restarted by the trainer: "
                                  "restart the server and resume from the last checkpoint.")
        self.acks.overdue()

    # ---- messages (main thread) ------------------------------------------------------------------------------
    def active_generators(self) -> list[int]:
        return list(range(self.num_generators))

    def send_request(self, generator_id: int, request: GenerationRequest) -> None:
        self._schedule(generator_id, self._generate(self._servers[generator_id], request))

    def send_weights(self, update: WeightUpdate) -> None:
        for server in self._servers:
            self.acks.sent(server.gid, update.version)
            self._schedule(server.gid, self._update(server, update))

    # ---- the loop thread ----------------------------------------------------------------------------------------
    def _schedule(self, gid: int, coro) -> None:
        """Run `coro` on the loop; whatever it raises is recorded against server `gid`. Calls run in FIFO order."""

        async def guarded():
            try:
                await coro
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # every failure is kept for `check`, whatever its type
                self._fail(gid, str(exc) if isinstance(exc, (ServerError, GeneratorFailed))
                           else f"{type(exc).__name__}: {exc}")

        def spawn():
            task = asyncio.ensure_future(guarded())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        self._loop.call_soon_threadsafe(spawn)

    async def _start(self, deadline: float) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        self._servers = [_Server(g, a, u) for g, (a, u) in enumerate(zip(self.addresses, self.urls))]
        for server in self._servers:
            server.version = self.initial_version
            server.gate.set()
            server.idle.set()
        from async_rlhf.weight_sync.network import write_probe

        # no transport: a pool that never sends weights (tests, benchmarks of sampling alone)
        probe = await asyncio.to_thread(write_probe, self.transport.shm_dir) if self.transport else ("", "")
        try:
            push = await asyncio.gather(*(self._connect(s, deadline, probe) for s in self._servers))
        finally:
            if probe[0]:
                os.unlink(probe[0])
        if any(push):  # the servers do not serve the trainer's starting policy: load it
            update = await asyncio.to_thread(self._publish_start)
            await asyncio.gather(*(self._start_weights(s, update) for s, p in zip(self._servers, push) if p))

    async def _start_weights(self, s: _Server, update: WeightUpdate) -> None:
        try:
            await self._update(s, update)
        except ServerError as exc:
            raise GeneratorFailed(f"generator start: {self.describe(s.gid)}: {exc}") from None

    def _publish_start(self) -> WeightUpdate:
        from async_rlhf.weight_sync.safetensors_io import state_from_model_dir

        return self.transport.publish(state_from_model_dir(self.model_dir), self.initial_version)

    async def _connect(self, s: _Server, deadline: float, probe: tuple[str, str]) -> bool:
        """Wait for `/health`, read the model, pick the transport, build the weight engine (for the network: form the
        group). Returns whether it needs the starting policy."""
        last = ""
        while True:
            try:
                await http_client.request_json(self._session, "GET", s.url, "/health",
                                               max(1.0, min(10.0, deadline - time.monotonic())), self.token)
                break
            except Unauthorized as exc:
                raise GeneratorFailed(f"generator start: {self.describe(s.gid)} {exc}") from None
            except ServerError as exc:  # not listening yet: the server may still be starting
                last = str(exc)
            if time.monotonic() > deadline:
                raise StageTimeout(f"generator start: {self.describe(s.gid)} did not answer within "
                                   f"generator_start_timeout={self.start_timeout:.0f}s ({last})")
            await asyncio.sleep(0.5)
        try:
            models = await http_client.request_json(self._session, "GET", s.url, "/v1/models", 30.0, self.token)
            info = await http_client.request_json(self._session, "GET", s.url, "/weight_info", 30.0, self.token)
            s.model, max_len = models["data"][0]["id"], models["data"][0]["max_model_len"]
            loaded = info["weight_version"]
            seen = await http_client.request_json(self._session, "POST", s.url, PROBE_ROUTE, 30.0, self.token,
                                                  {"path": probe[0], "nonce": probe[1]})
            reads_shm, workers, backend = bool(seen["reads_shm"]), int(seen["workers"]), seen["weight_backend"]
        except (ServerError, KeyError, IndexError, TypeError, ValueError) as exc:
            raise GeneratorFailed(f"generator start: {self.describe(s.gid)}: {type(exc).__name__}: {exc} (is it "
                                  "`python -m async_rlhf.generation.serve`?)") from None
        if max_len < self.min_model_len:
            raise GeneratorFailed(f"generator start: {self.describe(s.gid)} serves {s.model} with max_model_len "
                                  f"{max_len} < max_length {self.min_model_len}")
        if self.transport is None:
            return False
        try:
            # shm needs a backend that loads files (ours); a server on vLLM's nccl one takes the network only
            s.transport = choose_transport(self.weight_transport, self.describe(s.gid), same_gpu=False,
                                           sees_shm=reads_shm and backend in ("async_rlhf_gloo", "async_rlhf_shm"))
        except ValueError as exc:
            raise GeneratorFailed(f"generator start: {exc}") from None
        self.transport.use(s.transport)
        s.client = WeightSyncClient(s.url, self.token, self.weight_sync_timeout)
        if s.transport == "shm":
            s.engine = await http_client.in_daemon_thread(http_client.trainer_engine, s.client)
        else:
            options = dict(self.network)
            if options.get("backend", "auto") == "auto":  # the server's own backend decides: nccl or our gloo twin
                options["backend"] = "nccl" if backend == "nccl" else "gloo"
            wanted = {"gloo": "async_rlhf_gloo", "nccl": "nccl"}[options["backend"]]
            if backend != wanted:
                raise GeneratorFailed(f"generator start: {self.describe(s.gid)} runs the weight-transfer backend "
                                      f"{backend!r}; the network transport needs {wanted!r} (start it with "
                                      f"--weight-transfer-config '{{\"backend\": \"{wanted}\"}}')")
            s.engine = NetworkSender(s.client, workers, self.weight_sync_timeout, **options)
            try:
                await http_client.in_daemon_thread(s.engine.open)
            except Exception as exc:  # a refused token, a group that did not form, a server on another backend
                raise GeneratorFailed(f"generator start: {self.describe(s.gid)}: joining the weight group: "
                                      f"{type(exc).__name__}: {exc}") from None
        self.places[s.gid] = {"device": "server", "where": s.url, "weights": s.transport}
        logger.info("%s: serving %s (max_model_len %s, weight version %r, weights over %s)", self.describe(s.gid),
                    s.model, max_len, loaded, s.transport)
        return self.initial_version > 0 or loaded != "default"

    async def _generate(self, s: _Server, request: GenerationRequest) -> None:
        while s.updates_pending:  # weights sent before this request load first
            await s.gate.wait()
        s.in_flight += 1
        s.idle.clear()
        version, t0 = s.version, time.monotonic()
        settings = request.settings
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(http_client.generate(
                    self._session, s.url, s.model, prompt, request.settings_for(p),
                    None if settings.seed is None else settings.seed + p * settings.n, self.request_timeout,
                    self.token, self.initial_version)) for p, prompt in enumerate(request.prompt_token_ids)]
        except ExceptionGroup as group_error:
            raise group_error.exceptions[0] from None
        finally:
            s.in_flight -= 1
            if not s.in_flight:
                s.idle.set()
        completions = [t.result() for t in tasks]
        oldest = min(c.oldest_version(version) for group in completions for c in group)
        self.on_rollouts(RolloutBatch(
            batch_id=request.batch_id, generator_id=s.gid, policy_version=oldest, prompt_ids=request.prompt_ids,
            prompt_token_ids=request.prompt_token_ids, completions=completions,
            seconds=time.monotonic() - t0, chunk=request.chunk, num_chunks=request.num_chunks))

    async def _update(self, s: _Server, update: WeightUpdate) -> None:
        s.updates_pending += 1  # first, before any await: requests scheduled after this call wait for it
        s.gate.clear()
        try:
            async with s.update_lock:
                if self.weight_load == "drain":
                    await s.idle.wait()
                t0 = time.monotonic()
                try:
                    load = _load_under_requests if s.in_flight else _load
                    await http_client.in_daemon_thread(load, s, update, self.transport)
                except (ServerError, WeightTransportError) as exc:
                    raise ServerError(f"loading weights v{update.version} ({s.transport}): {exc}") from None
                s.version = update.version
                self.acks.acknowledged(s.gid, update.version, time.monotonic() - t0)
        finally:
            s.updates_pending -= 1
            if not s.updates_pending:
                s.gate.set()

    def _fail(self, gid: int, reason: str) -> None:
        logger.error("%s failed: %s", self.describe(gid) if gid >= 0 else "generator servers", reason)
        with self._lock:
            self._failed.setdefault(gid, reason)


def _send(s: _Server, update: WeightUpdate, transport) -> None:
    """One version through the server's engine (blocking): the shm file, or the bytes over its group."""
    if s.transport == "network":
        t0 = time.monotonic()
        s.engine.send(update.version, transport.state(update.version))
        transport.record_send(time.monotonic() - t0)
    else:
        s.engine.send_weights(for_transport(update, "shm"))


def _load(s: _Server, update: WeightUpdate, transport) -> None:
    """Load with nothing running (blocking; off the loop); cached prefix blocks of the old weights are dropped."""
    _send(s, update, transport)
    s.client.reset_prefix_cache()


def _load_under_requests(s: _Server, update: WeightUpdate, transport) -> None:
    """Load while requests run (blocking; off the loop): pause keeping them, load, recompute their context, resume."""
    s.client.pause_keep()
    try:
        _send(s, update, transport)
        s.client.reset_prefix_cache()
    finally:
        try:
            s.client.resume()
        except ServerError as exc:  # the load's own error, if any, is the one to report
            logger.error("generator server %s: /resume failed after a weight load: %s", s.address, exc)

