"""What a generator process does with its inbox once its engine is up: two loops, one per `generation_mode`.

Both serve the inbox in order as far as weights are concerned: a `WeightUpdate` queued before a `GenerationRequest`
is loaded before that request is sampled (the FIFO rule that lets the learner's admission bound staleness without
locks), and every rollout carries the version(s) that sampled it. Both return True on `Shutdown` or when the
parent died (checked every second while idle); an exception leaves them for `worker.py` to report.

* `serve_batches` (batch-level, the baseline): one message at a time; a request is one `generate` call, answered
  when its longest sample ends, or, when it carries `rows`, its multi-turn episodes (`episodes.py`). With
  `weight_load='in_flight'` the updates that arrive while a request's episodes run are loaded between two of their
  turns: the turns after the load sample with the new weights, and each episode records its tokens' versions.
* `serve_stream` (request-level: vLLM's engine, or the engine an optional schedule names): requests enter the engine
  as soon as they arrive, whatever it is running, and each is answered the moment its own samples end
  (`stream_engine.py`; the engine labels the versions and loads the weights, through its `begin` and
  `load_weights`). A weight update at the head of the inbox is loaded according to `weight_load`: "drain" waits
  until every sample already started has finished (they keep one version each; requests queued behind the update
  wait too), "in_flight" loads at once between two engine steps (running samples continue on the new weights,
  recomputed over their context; each token keeps its own version and behaviour log-prob). A message of any other
  kind goes to the engine's `handle` (an extension's own messages, `stream_engine.py`), and what it answers goes to
  the outbox.
A `WeightGroupJoin` (the "network" weight transport) joins learner rank 0's weight group; the learner queues it
first, ahead of any update.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import time

from async_rlhf.types import RolloutBatch, WeightAck


def _load(load, msg, generator_id: int, outbox, busy_seconds: float) -> int:
    """`load(msg)` (a backend's or a streaming engine's `load_weights`), then the acknowledgement."""
    t0 = time.perf_counter()
    load(msg)
    outbox.put(WeightAck(generator_id, msg.version, time.perf_counter() - t0, busy_seconds))
    return msg.version


def _spec(backend) -> dict:
    """The backend's cumulative speculation counters ({} without speculation, or for a backend without any)."""
    counters = getattr(backend, "spec_counters", None)
    return counters() if counters is not None else {}


def serve_batches(spec, backend, inbox, outbox, parent) -> bool:
    version = spec.initial_version
    busy = 0.0  # seconds in `generate`
    held: collections.deque = collections.deque()  # taken from the inbox between an episode's turns, not yet served
    episodes = None  # the episode runner, for requests with `rows` (`episodes.py`)
    if spec.episodes is not None:
        from async_rlhf.generation.engine.episodes import EpisodeRunner

        episodes = EpisodeRunner(spec.episodes, backend)

    def between_turns() -> int:
        """`weight_load='in_flight'`, between two turns of a request's episodes: load the updates that arrived
        behind the request, up to the next message of another kind (which keeps its place), and return the
        version loaded. Updates queued before the request were loaded before it (the FIFO rule holds)."""
        nonlocal version
        try:
            while True:
                held.append(inbox.get_nowait())
        except queue.Empty:
            pass
        while held and held[0].kind == "weights":
            version = _load(backend.load_weights, held.popleft(), spec.generator_id, outbox, busy)
        return version

    while True:
        if held:
            msg = held.popleft()
        else:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return True
                continue
        if msg.kind == "shutdown":
            return True
        if msg.kind == "weights":
            version = _load(backend.load_weights, msg, spec.generator_id, outbox, busy)
        elif msg.kind == "weight_group":
            backend.join_weight_group(msg.init_info)
        elif msg.kind == "generate":
            t0 = time.perf_counter()
            started = version  # the oldest version of any token of the request: the batch's
            prompts = msg.prompt_token_ids
            if msg.rows:
                if episodes is None:
                    raise ValueError(f"generator {spec.generator_id}: a request of episodes (rows), but this "
                                     "generator was started without tools or environments")
                prompts, completions = episodes.run(
                    msg, version, between_turns if spec.weight_load == "in_flight" else None)
            else:
                completions = backend.generate(msg.prompt_token_ids, msg.settings, msg.max_new_tokens or None)
            busy += time.perf_counter() - t0
            outbox.put(RolloutBatch(batch_id=msg.batch_id, generator_id=spec.generator_id, policy_version=started,
                                    prompt_ids=msg.prompt_ids, prompt_token_ids=prompts,
                                    completions=completions, seconds=time.perf_counter() - t0, chunk=msg.chunk,
                                    num_chunks=msg.num_chunks, spec=_spec(backend)))
        else:
            raise ValueError(f"generator {spec.generator_id}: unknown message kind {msg.kind!r}")


def serve_stream(spec, backend, inbox, outbox, parent) -> bool:
    from async_rlhf.generation.engine.stream_engine import StreamEngine

    engine = (spec.stream_engine or StreamEngine)(backend, spec.generator_id)
    engine.begin(spec.initial_version)  # the version of the first tokens
    version = spec.initial_version
    fifo: collections.deque = collections.deque()  # received, not yet served
    while True:
        idle = not engine.busy and not fifo
        try:  # take everything that has arrived; wait (and watch the parent) only when there is nothing to do
            fifo.append(inbox.get(timeout=1.0) if idle else inbox.get_nowait())
            while True:
                fifo.append(inbox.get_nowait())
        except queue.Empty:
            if idle and not fifo and parent is not None and not parent.is_alive():
                return True
        while fifo:
            msg = fifo[0]
            if msg.kind == "shutdown":
                return True
            if msg.kind == "weights":
                if spec.weight_load == "drain" and engine.busy:
                    break  # the head waits for the samples already started; so does everything behind it
                version = _load(engine.load_weights, msg, spec.generator_id, outbox, engine.busy_seconds)
            elif msg.kind == "weight_group":  # first in the inbox: nothing is running yet
                backend.join_weight_group(msg.init_info)
            elif msg.kind == "generate":
                engine.submit(msg, version)
            else:
                for answer in engine.handle(msg, version):
                    outbox.put(answer)
            fifo.popleft()
        if engine.busy:
            finished = engine.step(version)
            counters = _spec(backend) if finished else {}
            for rollouts in finished:
                outbox.put(dataclasses.replace(rollouts, spec=counters) if counters else rollouts)
