"""The "network" weight transport for local generator processes (and Ray actors): one feed per generator incarnation.
Lives on learner rank 0, owned by `pool.GeneratorPool`.

A generator process has no HTTP route: its inbox is its authenticated channel (a multiprocessing queue, or Ray's).
So the trainer-side engine (`weight_sync.network.NetworkSender`, vLLM's factory) gets an `InboxClient` as its
`VLLMWeightSyncClient`: `init_weight_transfer_engine` puts a `WeightGroupJoin` into the inbox, and the per-version
calls are left to the generator, which runs vLLM's start / update / finish itself when the `WeightUpdate` reaches
the head of its inbox (FIFO with its requests, which is what bounds staleness), while the feed's thread broadcasts.

Rendezvous, and how a restarted or added generator joins: `open(gid, inbox)` is called when the pool creates the
process (spawn, restart, `add_generator`), before anything else is queued to it. It starts the feed's thread, which
binds the group's socket and puts the `WeightGroupJoin` first in the inbox (`open` returns once it is there), then
forms the group as rank 0 while the generator starts its engine and joins. Every update the pool queues to that
inbox afterwards is also handed to the feed (`send`), which sends the versions in that order. So a restarted
generator, or one added by the autoscaler, is in a group of its own before its first update: the newest version
queued at its start, then every later one. A replaced incarnation's feed is closed (`drop`); its group dies with it.

Guarantees: a feed never blocks the pool (sends happen on its thread); the rendezvous is bounded by
`start_timeout + weight_sync_timeout` (the engine must start first) and so is every collective of the group; a
send that fails is logged and ends the feed: the generator fails the same update on its side and exits, and the
pool restarts it with a new feed (or fails the run naming it, past `generator_max_restarts`), and an update never
acknowledged is `StageTimeout` (`AckTracker`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from async_rlhf.types import WeightGroupJoin

logger = logging.getLogger(__name__)


class InboxClient:
    """vLLM's `VLLMWeightSyncClient` over a local generator's inbox (see the module docstring)."""

    def __init__(self, inbox) -> None:
        self.inbox = inbox
        self.queued = threading.Event()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.inbox.put(WeightGroupJoin(init_info))
        self.queued.set()

    def start_weight_update(self) -> None:  # the generator starts, updates and finishes with the update it reads
        pass

    def update_weights(self, update_info) -> None:
        pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


class _Feed:
    def __init__(self, gid: int, inbox, transport, options: dict, timeout: float, workers: int):
        from async_rlhf.weight_sync.network import NetworkSender

        self.gid = gid
        self.client = InboxClient(inbox)
        self.sender = NetworkSender(self.client, workers, timeout, **options)
        self.transport = transport
        self.versions: queue.Queue = queue.Queue()
        self.closed = False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"async_rlhf-weight-feed-{gid}")
        self.thread.start()

    def _run(self) -> None:
        try:
            self.sender.open()
            while True:
                version = self.versions.get()
                if version is None:
                    return
                t0 = time.monotonic()
                self.sender.send(version, self.transport.state(version))
                self.transport.record_send(time.monotonic() - t0)
        except Exception as exc:  # the generator fails the same round on its side; the pool restarts it
            if not self.closed:
                logger.warning("weight feed of generator %d ended: %s: %s", self.gid, type(exc).__name__, exc)
        finally:
            self.client.queued.set()  # never leave `open` waiting
            self.sender.close()


class NetworkFeeds:
    """The feeds of one pool: `open` at each process creation, `send` with each update queued, `drop`, `close`."""

    def __init__(self, transport, options: dict, timeout: float, workers: int = 1):
        self.transport = transport  # weight_sync.network.StateTransport
        self.options = dict(options)
        self.timeout = timeout
        self.workers = workers  # vLLM workers per generator (its tensor-parallel size)
        self._feeds: dict[int, _Feed] = {}

    def open(self, gid: int, inbox) -> None:
        self.drop(gid)
        feed = _Feed(gid, inbox, self.transport, self.options, self.timeout, self.workers)
        self._feeds[gid] = feed
        if not feed.client.queued.wait(60.0):  # binding a socket and one queue put
            raise RuntimeError(f"generator {gid}: the weight group's join message was not queued within 60 s")

    def send(self, gid: int, version: int) -> None:
        self._feeds[gid].versions.put(version)

    def drop(self, gid: int) -> None:
        feed = self._feeds.pop(gid, None)
        if feed is not None:
            feed.closed = True
            feed.versions.put(None)  # a feed blocked in a collective ends at the group's timeout, as a daemon

    def close(self) -> None:
        for gid in list(self._feeds):
            self.drop(gid)
