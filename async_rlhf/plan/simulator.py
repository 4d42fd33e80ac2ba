"""A discrete-event simulation of our pipeline, step by step as `pipeline/rollout_pipeline.py` runs it.

What it models (and where the rule lives in the code):
- **Admission** (`pipeline._dispatch`, `StalenessQueue.admissible`): batch c is dispatched once the newest weights
  queued to the generators have version >= c - S; at the start, batches 0..S go at once.
- **Messages** from the learner reach a generator's inbox `dispatch_seconds` after they are sent (on one machine:
  pickling and the pipe, slowed when the learner's training holds the GIL), in the order they were sent.
- **Scoring while generating** (`scoring/stage.py`): each returned part waits for rank 0's one scoring thread, which
  takes `score_seconds` per part, parts in arrival order (0: scored in the learner's step, inside `train_seconds`).
- **The learner**: step b starts when batch b is complete (all its parts returned and scored, plus `handoff_seconds`:
  the IPC and reassembly between the last part leaving its generator and the batch entering the queue) and
  the previous step has ended; it takes `train_seconds`, then, every `sync_every` steps, `sync_seconds` (gather and
  publish, on the learner's critical path), after which the weights are queued to every generator and admission
  is checked again.
- **Generators** serve a FIFO inbox (`generation/engine/serve_loops.py`): a weight update is loaded (`load_seconds`) before
  any request queued after it. Batch-level (`mode="batch"`): one request at a time, answered when its longest
  sample ends; one contiguous chunk of equal prompt count per generator. Streaming (`mode="stream"`): one request
  per prompt group, entering the engine at once next to whatever it runs, answered when its own samples end; a
  weight update waits for the running samples to end (`weight_load="drain"`) or loads between two engine steps
  (`"in_flight"`). Groups go to the generator with the least expected work in flight (`pipeline/assignment.py`).
- **The engine**: one step advances every running sequence by one token and takes
  `overhead + max(weight_read + kv_per_seq * r, compute_per_seq * r)` seconds with r sequences running (memory-bound
  decode reads the weights once per step plus each sequence's KV cache; compute-bound past the knee); at most
  `max_running` sequences run at once (KV cache), the rest wait. Prefill costs `prefill_token` per prompt token,
  added to the step in which a request enters.
- **Lengths**: every sample's length is drawn from `lengths` (an empirical sample or quantiles of a distribution),
  seeded, so that batch latency reflects the longest sample, as it does in a run.

Not modelled: generator restarts, dropped batches (admission makes them impossible in a normal run), CPU
contention between stages (on a shared CPU it is inside the measured stage times fed in).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import random
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class EngineModel:
    overhead: float = 0.0           # seconds per step, whatever runs
    weight_read: float = 0.0        # seconds per step reading the weights (memory-bound decode)
    kv_per_seq: float = 0.0         # seconds per step per running sequence reading its KV cache
    compute_per_seq: float = 0.0    # seconds per step per running sequence of arithmetic
    prefill_token: float = 0.0      # seconds per prompt token entering the engine
    max_running: int = 1 << 30      # sequences the KV cache holds at once

    def step(self, running: int) -> float:
        return self.overhead + max(self.weight_read + self.kv_per_seq * running, self.compute_per_seq * running)


@dataclasses.dataclass(frozen=True)
class SimConfig:
    steps: int
    max_staleness: int
    prompts_per_step: int
    n: int
    engine: EngineModel
    lengths: Sequence[int]          # response lengths drawn from (tokens)
    train_seconds: float            # learner, one optimizer step, sync excluded
    sync_seconds: float = 0.0       # learner, one weight sync (gather + publish)
    load_seconds: float = 0.0       # generator, loading one weight update
    handoff_seconds: float = 0.0    # last part out of its generator -> batch ready for the learner
    dispatch_seconds: float = 0.0   # a message from the learner reaching a generator's inbox
    score_seconds: float = 0.0      # rank 0's scoring thread, per part, one part after another in arrival order
    generators: int = 1
    sync_every: int = 1
    mode: str = "stream"            # "stream" | "batch"
    weight_load: str = "drain"      # "drain" | "in_flight" (streaming only)
    prompt_tokens: int = 0
    seed: int = 0

    def __post_init__(self):
        checks = [("steps", self.steps >= 1), ("max_staleness", self.max_staleness >= 0),
                  ("prompts_per_step", self.prompts_per_step >= 1), ("n", self.n >= 1),
                  ("generators", self.generators >= 1), ("sync_every", 1 <= self.sync_every <= self.max_staleness + 1),
                  ("mode", self.mode in ("stream", "batch")), ("weight_load", self.weight_load in ("drain", "in_flight")),
                  ("lengths", len(self.lengths) > 0 and min(self.lengths) >= 1),
                  ("train_seconds", self.train_seconds >= 0)]
        bad = [name for name, ok in checks if not ok]
        if bad:
            raise ValueError(f"SimConfig: invalid {bad[0]} = {getattr(self, bad[0])!r}")


@dataclasses.dataclass
class SimResult:
    total_seconds: float            # first dispatch -> end of the last step (the run's training loop)
    step_ends: list[float]
    learner_wait_seconds: float
    generator_busy_seconds: list[float]
    staleness: dict[int, int]       # steps behind: batches

    @property
    def step_seconds(self) -> float:
        return self.total_seconds / len(self.step_ends)

    @property
    def steady_step_seconds(self) -> float:
        """Mean step time after the first quarter of the steps (start-up excluded)."""
        k = len(self.step_ends) // 4
        if k == 0 or len(self.step_ends) - k < 1:
            return self.step_seconds
        return (self.step_ends[-1] - self.step_ends[k - 1]) / (len(self.step_ends) - k)

    @property
    def staleness_mean(self) -> float:
        total = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / total if total else 0.0


class _Request:
    __slots__ = ("batch", "chunk", "lengths", "prompt_tokens", "left", "version")

    def __init__(self, batch, chunk, lengths, prompt_tokens):
        self.batch, self.chunk, self.lengths, self.prompt_tokens = batch, chunk, lengths, prompt_tokens
        self.left = len(lengths)
        self.version = 0


class _Generator:
    def __init__(self):
        self.inbox: collections.deque = collections.deque()
        self.version = 0
        self.running: list = []            # heap of (engine step at which it ends, id, request); batch mode: a marker
        self.count = 0                     # engine steps taken so far (a sequence ends when count reaches its end)
        self.waiting: collections.deque = collections.deque()  # sequences admitted, no KV room yet
        self.busy_until = 0.0              # end of the current step / load / batch request
        self.token = 0                     # the current engine event's id (older events are stale)
        self.step_start = 0.0
        self.step_len = 0.0
        self.prefill_extra = 0.0           # the first planned step also prefills the requests that entered
        self.steps_planned = 0
        self.check_pending = False
        self.pending_prefill = 0
        self.busy = 0.0


class Simulator:
    def __init__(self, cfg: SimConfig):
        self.c = cfg
        self.rng = random.Random(cfg.seed)
        self.events: list = []
        self.seq = 0
        self.gens = [_Generator() for _ in range(cfg.generators)]
        self.in_flight = [0.0] * cfg.generators   # expected tokens sent, not returned (assignment)
        self.parts_left: dict[int, int] = {}
        self.part_versions: dict[int, list[int]] = collections.defaultdict(list)
        self.ready: dict[int, float] = {}
        self.queued_version = 0
        self.next_dispatch = 0
        self.next_step = 0
        self.learner_free = 0.0
        self.scorer_free = 0.0
        self.learner_busy = False
        self.wait = 0.0
        self.step_ends: list[float] = []
        self.staleness: collections.Counter = collections.Counter()
        self.mean_len = sum(cfg.lengths) / len(cfg.lengths)

    def _push(self, t: float, kind: str, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    # ---- the learner side ------------------------------------------------------------------------------------
    def _dispatch(self, t: float) -> None:
        c = self.c
        while self.next_dispatch < c.steps and self.next_dispatch - c.max_staleness <= self.queued_version:
            self._send(t, self.next_dispatch)
            self.next_dispatch += 1

    def _send(self, t: float, b: int) -> None:
        c = self.c
        groups = [[self.rng.choice(c.lengths) for _ in range(c.n)] for _ in range(c.prompts_per_step)]
        if c.mode == "batch":
            chunks = min(c.generators, c.prompts_per_step)
            bounds = [round(i * c.prompts_per_step / chunks) for i in range(chunks + 1)]
            parts = [([x for g in groups[bounds[k]:bounds[k + 1]] for x in g], (b + k) % c.generators,
                      bounds[k + 1] - bounds[k]) for k in range(chunks)]
        else:  # one request per group, least expected work in flight first (all groups look alike before sampling)
            parts = []
            for g in groups:
                owner = min(range(c.generators), key=lambda k: (self.in_flight[k], k))
                self.in_flight[owner] += c.n * self.mean_len
                parts.append((g, owner, 1))
        self.parts_left[b] = len(parts)
        for k, (lengths, owner, prompts) in enumerate(parts):
            self._post(t, owner, ("generate", _Request(b, k, lengths, prompts * c.prompt_tokens)))

    def _try_train(self, t: float) -> None:
        b = self.next_step
        if self.learner_busy or b >= self.c.steps or b not in self.ready:
            return
        start = max(t, self.learner_free)
        self.wait += max(0.0, start - self.learner_free)
        self.staleness[b - min(self.part_versions.pop(b))] += 1
        self.learner_busy = True
        end = start + self.c.train_seconds
        synced = (b + 1) % self.c.sync_every == 0
        if synced:
            end += self.c.sync_seconds
        self._push(end, "step_end", b, synced)

    def _step_end(self, t: float, b: int, synced: bool) -> None:
        self.learner_busy = False
        self.learner_free = t
        self.step_ends.append(t)
        self.next_step = b + 1
        if synced:
            self.queued_version = b + 1
            for g in range(len(self.gens)):
                self._post(t, g, ("weights", b + 1))
        self._dispatch(t)
        self._try_train(t)

    # ---- the generator side ----------------------------------------------------------------------------------
    def _post(self, t: float, g: int, msg) -> None:
        if self.c.dispatch_seconds > 0:
            self._push(t + self.c.dispatch_seconds, "arrive", g, msg)  # FIFO kept: same delay, pushed in order
        else:
            self._arrive(t, g, msg)

    def _arrive(self, t: float, g: int, msg) -> None:
        gen = self.gens[g]
        gen.inbox.append(msg)
        if self.c.mode == "batch":
            if gen.busy_until <= t and not gen.running:
                self._serve_batch(t, g)
        elif gen.steps_planned and not (msg[0] == "weights" and self.c.weight_load == "drain"):
            self._interrupt(t, g)   # requests (and in-flight loads) join at the next step boundary
        elif not gen.running and gen.busy_until <= t and not gen.check_pending:
            gen.check_pending = True  # served once every message of this instant is in (a batch's groups enter together)
            self._push(t, "idle_check", g)

    def _serve_batch(self, t: float, g: int) -> None:
        gen = self.gens[g]
        if not gen.inbox:
            return
        kind, x = gen.inbox.popleft()
        if kind == "weights":
            gen.version, dt = x, self.c.load_seconds
        else:
            x.version = gen.version
            lengths = sorted(x.lengths)
            dt = x.prompt_tokens * self.c.engine.prefill_token
            prev = 0
            for i, length in enumerate(lengths):  # between two ends, len(lengths) - i sequences run
                dt += (length - prev) * self.c.engine.step(len(lengths) - i)
                prev = length
        gen.busy_until = t + dt
        gen.busy += dt
        gen.running = [[0, None]]  # marks it busy until the event
        self._push(t + dt, "batch_done", g, x if kind == "generate" else None)

    def _serve_stream(self, t: float, g: int) -> None:
        """At a step boundary (or idle): take inbox messages in order, then plan the next engine steps."""
        gen, c = self.gens[g], self.c
        load = 0.0
        while gen.inbox:
            kind, x = gen.inbox[0]
            if kind == "weights":
                if c.weight_load == "drain" and (gen.running or gen.waiting):
                    break
                gen.version, load = x, load + c.load_seconds
            else:
                x.version = gen.version
                gen.pending_prefill += x.prompt_tokens
                gen.waiting.extend([length, x] for length in x.lengths)
            gen.inbox.popleft()
        while gen.waiting and len(gen.running) < c.engine.max_running:
            length, req = gen.waiting.popleft()
            self.seq += 1
            heapq.heappush(gen.running, (gen.count + length, self.seq, req))
        if not gen.running:
            if load:
                gen.busy += load
                gen.busy_until = t + load
                self._push(t + load, "idle_check", g)
            return
        r = len(gen.running)
        dur = c.engine.step(r)
        k = gen.running[0][0] - gen.count
        first = dur + gen.pending_prefill * c.engine.prefill_token
        gen.pending_prefill = 0
        gen.token += 1
        gen.step_start, gen.step_len, gen.steps_planned = t + load, dur, k
        gen.prefill_extra = first - dur
        end = t + load + first + (k - 1) * dur
        gen.busy += end - t
        gen.busy_until = end
        self._push(end, "engine", g, gen.token, first - dur)

    def _interrupt(self, t: float, g: int) -> None:
        """A message arrived mid-plan: cut the planned steps at the step in progress."""
        gen = self.gens[g]
        elapsed = t - gen.step_start - gen.prefill_extra
        done = max(1, math.floor(elapsed / gen.step_len) + 1) if gen.step_len > 0 else 1
        if done >= gen.steps_planned:
            return
        end = gen.step_start + gen.prefill_extra + done * gen.step_len
        gen.busy -= gen.busy_until - end
        gen.busy_until = end
        gen.steps_planned = done
        gen.token += 1
        self._push(end, "engine", g, gen.token, 0.0)

    def _engine(self, t: float, g: int) -> None:
        gen = self.gens[g]
        k = gen.steps_planned
        gen.steps_planned = 0
        gen.count += k
        while gen.running and gen.running[0][0] <= gen.count:
            req = heapq.heappop(gen.running)[2]
            req.left -= 1
            if req.left == 0:
                self.in_flight[g] -= self.c.n * self.mean_len
                self._part_done(t, req)
        self._serve_stream(t, g)

    def _part_done(self, t: float, req: _Request) -> None:
        if self.c.score_seconds > 0:  # one scoring thread: a part waits for the parts that arrived before it
            self.scorer_free = max(t, self.scorer_free) + self.c.score_seconds
            self._push(self.scorer_free, "scored", req)
        else:
            self._part_scored(t, req)

    def _part_scored(self, t: float, req: _Request) -> None:
        self.part_versions[req.batch].append(req.version)
        self.parts_left[req.batch] -= 1
        if self.parts_left[req.batch] == 0:
            self._push(t + self.c.handoff_seconds, "ready", req.batch)

    def run(self) -> SimResult:
        self._dispatch(0.0)
        while self.events:
            t, _, kind, p = heapq.heappop(self.events)
            if kind == "step_end":
                self._step_end(t, *p)
            elif kind == "ready":
                self.ready[p[0]] = t
                self._try_train(t)
            elif kind == "batch_done":
                g, req = p
                self.gens[g].running = []
                if req is not None:
                    self._part_done(t, req)
                self._serve_batch(t, g)
            elif kind == "engine":
                g, token, _ = p
                if token == self.gens[g].token:
                    self._engine(t, g)
            elif kind == "scored":
                self._part_scored(t, p[0])
            elif kind == "arrive":
                self._arrive(t, *p)
            elif kind == "idle_check":
                gen = self.gens[p[0]]
                gen.check_pending = False
                if not gen.steps_planned and gen.busy_until <= t:
                    self._serve_stream(t, p[0])
        if len(self.step_ends) != self.c.steps:
            raise RuntimeError(f"simulation stalled after {len(self.step_ends)} of {self.c.steps} steps")
        return SimResult(self.step_ends[-1], self.step_ends, self.wait, [g.busy for g in self.gens],
                         dict(sorted(self.staleness.items())))


def simulate(cfg: SimConfig) -> SimResult:
    return Simulator(cfg).run()
