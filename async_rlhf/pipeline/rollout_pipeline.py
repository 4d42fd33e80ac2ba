"""The asynchronous rollout pipeline: wires prompts -> generators -> staleness queue -> learner -> weights.

This is the one place that owns processes and threads. On learner rank 0 it holds the `GeneratorPool`
(generator processes + a reader thread), the `StalenessQueue` and the weight transport (and, with
`generator_autoscale`, `experimental/elastic.py`'s controller, which adds and retires generators after optimizer
steps); other ranks hold nothing and receive each step's rollouts from rank 0 by broadcast.

Step protocol, per optimizer step b (every learner rank calls both, in this order):
1. `batch_for_step(b)`: rank 0 waits (at most `rollout_timeout`) for batch b, checks its staleness
   (version >= b - max_staleness, else drops and regenerates it), and broadcasts it to all ranks. With
   `partial_rollouts` the batch is instead the first finished groups within the bound (`experimental/partial_rollouts.py`).
   Trainers ask for it one micro-batch at a time (`micro_batch`), in arrival order with `train_while_generating`
   (`experimental/arrival_order.py`).
2. After the optimizer step, `after_optimizer_step(model, b + 1)`: every `sync_every` steps the weights are
   gathered (a collective, for sharded learners), published, and queued to every generator; then rank 0
   dispatches every batch that admission now allows (batch c is sent once the queued version >= c - S).

Policy versions: the truth is the learner's optimizer-step count, `trainer.state.global_step` (version v = the
weights after v optimizer steps; it is what a checkpoint restores). Everything else is derived from it and never
counted on its own: `queued_version` is the step of the last weight sync (set only from the step passed to
`after_optimizer_step`, or the checkpoint's step at start), a generator's loaded version is the `WeightUpdate.version`
it last loaded (`pool.acks`), and a `RolloutBatch.policy_version` is the version its oldest token was sampled with
(the generator's loaded version when it took the request; later tokens may be newer with in-flight loads).

Generation therefore overlaps training by up to `max_staleness` steps and never more. The learner never waits
for a weight *load*: FIFO inboxes guarantee a generator loads version v before it samples any batch dispatched
after v was queued.

A weight publish that fails on rank 0 (`OSError`: `shm_dir` full, ...) is raised as `GeneratorFailed` by the next
wait for rollouts, so every rank leaves the loop at the same step and the trainer saves its failure checkpoint.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Callable

from async_rlhf.experimental.arrival_order import ArrivalOrder
from async_rlhf.pipeline.assignment import ImbalanceTally, LengthEstimator, assign
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.pipeline.generator_pool import GeneratorPoolProtocol
from async_rlhf.errors import GeneratorFailed
from async_rlhf.generation.pool.choice import make_pool
from async_rlhf.experimental.partial_rollouts import PartialRollouts, restore_partial
from async_rlhf.pipeline.records import PipelineRecords
from async_rlhf.pipeline.prompt_stream import PromptStream
from async_rlhf.pipeline.staleness_queue import StalenessQueue
from async_rlhf.errors import StageTimeout
from async_rlhf.types import GenerationRequest, RolloutBatch, SamplingSettings
from async_rlhf.weight_sync import gather_full_state
from async_rlhf.weight_sync.transport import WeightTransport
from async_rlhf.errors import WeightTransportError
from async_rlhf.pipeline.rank_share import check_logprobs_finite, share_batch
from async_rlhf.errors import RewardError
from async_rlhf.scoring.stage import ScoringStage

logger = logging.getLogger(__name__)


class RolloutPipeline(PipelineRecords):
    def __init__(self, args, prompt_token_ids: list[list[int]], generator_model_path: str, accelerator,
                 total_steps: int, settings: SamplingSettings, engine_kwargs: dict | None = None,
                 score: list[tuple[str, Callable[[list[RolloutBatch]], list[RolloutBatch]]]] | None = None,
                 budgets: list[int] | None = None, early_pool: GeneratorPool | None = None):
        """`score`: the stages that score a part on rank 0 as it arrives (`scoring/stage.py`); None: the learner
        scores batches.
        `budgets`: each prompt's own `max_new_tokens` (a dataset column, `data/prompts.py`); None: the settings'.
        `early_pool`: generators spawned while the learner loaded (`generation/pool/early_start.py`): `start` uses them
        if they are what it would start, else closes them."""
        self.args = args
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.prompt_token_ids = prompt_token_ids
        self.stream = PromptStream(len(prompt_token_ids), args.prompts_per_step, args.seed)
        self.total_steps = total_steps
        self.settings = settings
        self.generator_model_path = generator_model_path
        self.engine_kwargs = engine_kwargs or {}
        self.queue = StalenessQueue(args.max_staleness)
        self.pool: GeneratorPoolProtocol | None = None  # GeneratorPool, or HTTPGeneratorPool (generator_servers)
        self.elastic = None  # ElasticGenerators with generator_autoscale (experimental/elastic.py)
        self.autoscale: dict = {}  # its summary, kept after close
        self.transport: WeightTransport | None = None  # ShmWeightTransport (local generators and servers)
        self.queued_version = 0  # newest weights sent to the generators (derived: see the module docstring)
        self.next_dispatch = 0  # next batch id to send
        self.regenerated = 0
        self.timers: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.sync_bytes = 0
        self.syncs = 0
        self.gen_tokens = 0
        self.gen_seconds = 0.0
        self.start_seconds = 0.0  # generators spawned -> ready
        self.start_wait_seconds = 0.0  # of which the learner waited in `start`
        self.load_seconds = 0.0  # generator-side weight loading, summed (kept after close)
        self.busy_seconds = 0.0  # generator-side sampling time, summed (kept after close; local generators only)
        self.loaded_versions: dict[int, int] = {}  # generator id -> last acknowledged version (kept after close)
        self.restarts = 0
        self.spec: dict[int, dict] = {}  # generator id -> its latest cumulative speculation counters (reader thread)
        self._partial: dict[int, dict[int, RolloutBatch]] = {}  # batch id -> chunk -> rollouts (reader thread)
        self._sync_failure: GeneratorFailed | None = None  # a failed publish, raised by the next batch_for_step
        self._score = score
        self.scoring: ScoringStage | None = None
        self._early_pool = early_pool
        self.budgets = budgets
        self.lengths = LengthEstimator(settings.max_new_tokens, budgets)  # observed by the reader thread, read by dispatch
        self.pool_size = 0  # generators, once started
        self._in_flight_tokens = collections.defaultdict(float)  # generator -> expected tokens sent, not returned
        self._owners: dict[tuple[int, int], list] = {}  # (batch, part) -> [(generator, expected tokens)] per send
        self._load_lock = threading.Lock()  # the three above: dispatch (main thread) and the reader thread
        self.imbalance = ImbalanceTally()  # generator/imbalance: max/mean tokens per generator
        self.tail = None  # local pools: `experimental/tail_migration.py`'s counters
        # per-batch stage timing for the planner (`plan/feedback.py`): dispatch and last part's arrival on rank 0
        self._dispatched_at: dict[int, float] = {}
        self._arrived_at: dict[int, float] = {}
        self.length_counts: collections.Counter = collections.Counter()  # completion tokens: samples (reader thread)
        self.latency = [0.0, 0.0, 0]  # summed dispatch -> queued and last part arrived -> queued seconds; batches
        # partial rollouts (`experimental/partial_rollouts.py`): steps gather finished groups of several admitted batches
        self.partial = (PartialRollouts(args.prompts_per_step, args.max_staleness, args.partial_rollouts, self._send)
                        if getattr(args, "partial_rollouts", 0) else None)
        # train_while_generating (`experimental/arrival_order.py`): micro-batches of a step's groups in arrival order
        self.arrivals = ArrivalOrder(args.max_staleness) if getattr(args, "train_while_generating", False) else None
        self._step_batch: RolloutBatch | None = None  # the current step's whole batch (see `micro_batch`)
        self._fused_step = False  # the current step's micro-batches are taken in arrival order

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self, initial_version: int = 0, pending: list[RolloutBatch] = (), counters: dict | None = None) -> None:
        """Start the generators at `initial_version` (> 0 when resuming: the generators then start from the
        checkpoint's weights), with rollouts restored from a checkpoint already queued."""
        self.queued_version = initial_version
        self.next_dispatch = initial_version
        if not self.is_main:
            return
        self.restore_counters(counters or {})
        if self.partial is not None or (counters or {}).get("partial"):
            restore_partial(self.partial, getattr(self.args, "partial_rollouts", 0), initial_version, pending,
                            counters or {})
        else:
            for batch in pending:
                if batch.batch_id >= initial_version:
                    self.queue.put(batch)
        if initial_version >= self.total_steps:  # resumed from the final checkpoint: nothing left to generate
            return
        if self._score is not None:
            self.scoring = ScoringStage(self._score, self._assemble)
        early, self._early_pool = self._early_pool, None
        self.transport, self.pool, self.elastic = make_pool(
            self.args, self._on_rollouts, self.generator_model_path, self.engine_kwargs, initial_version, early,
            self.accelerator.num_processes, self.accelerator.device)
        self.tail = getattr(self.pool, "tail", None)  # `tail_migration`'s counters, kept after the pool closes
        try:
            self.pool.start()
        except BaseException:
            self.close()
            raise
        self.start_seconds = self.pool.start_seconds
        self.start_wait_seconds = getattr(self.pool, "start_wait_seconds", self.start_seconds)
        self.pool_size = self.pool.num_generators
        self._dispatch()

    def pending(self, step: int) -> list[RolloutBatch]:
        """Rollouts generated but not trained yet, for a checkpoint at `step` (finished groups with partial rollouts)."""
        if self.partial is not None:
            return self.partial.state()[1]
        return [b for b in self.queue.pending() if b.batch_id >= step]

    def close(self) -> None:
        if self.elastic is not None:
            self.autoscale = self.elastic.summary()
        if self._early_pool is not None:  # never started (rank 0 resumed from the final checkpoint)
            self._early_pool.close()
            self._early_pool = None
        if self.pool is not None:
            self.pool.close()  # first: it may still record the acknowledgements of the last weights
            self.load_seconds = sum(self.pool.acks.load_seconds)
            self.busy_seconds = sum(self.pool.acks.busy_seconds.values())
            self.loaded_versions = dict(self.pool.acks.loaded_version)
            self.restarts = sum(self.pool.restarts.values())
            self.pool = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self.scoring is not None:
            self.scoring.close()

    def begin_stop(self) -> None:
        """The run is stopping (SIGINT/SIGTERM): the pool restarts no generator from now on. Signal-handler safe."""
        if self.pool is not None:
            self.pool.begin_stop()

    # ---- the step protocol -------------------------------------------------------------------------------
    def batch_for_step(self, step: int) -> RolloutBatch:
        """Batch `step` on every rank. A generator failure or a timeout on rank 0 is raised on every rank (the
        same type and message), so all ranks leave the loop at the same step and can checkpoint together."""
        return self._on_every_rank(lambda: self._take_batch(step))

    def micro_batch(self, step: int, micro: int, micro_batches: int) -> RolloutBatch:
        """Micro-batch `micro` of `micro_batches` of step `step`, on every rank: `per_device_train_batch_size` groups
        per rank, rank r's at rows [r * per, (r + 1) * per). Its slice of the whole batch in prompt order; with
        `train_while_generating`, the next groups in arrival order, each micro-batch but the last as soon as they
        have arrived (`experimental/arrival_order.py`). After the last one, `trained_batch` is the step's whole batch (rank 0)."""
        count = self.args.per_device_train_batch_size * self.accelerator.num_processes
        if self.arrivals is None:  # one broadcast per step, as `batch_for_step`
            if micro == 0:
                self._step_batch = self.batch_for_step(step)
            return self._step_batch.select(list(range(micro * count, (micro + 1) * count)))
        return self._on_every_rank(lambda: self._take_micro(step, micro, micro_batches, count))

    @property
    def trained_batch(self) -> RolloutBatch | None:
        return self._step_batch  # the whole batch of the step whose micro-batches were taken last (rank 0)

    def _on_every_rank(self, take: Callable[[], RolloutBatch]) -> RolloutBatch:
        """`take()` on rank 0, its result (or its failure) on every rank."""
        batch, failure = None, None
        if self.is_main:
            try:
                batch = take()
            except (GeneratorFailed, StageTimeout, RewardError) as exc:
                if self.accelerator.num_processes == 1:
                    raise
                failure = exc
        if self.accelerator.num_processes > 1:
            batch = share_batch(batch, failure, self.accelerator.device)
        return batch

    def _take_micro(self, step: int, micro: int, micro_batches: int, count: int) -> RolloutBatch:
        """Rank 0, `train_while_generating`: micro-batch `micro` of step `step` (see `micro_batch`)."""
        self.total_steps = max(self.total_steps, step + 1)
        if micro == 0:  # a batch restored from a checkpoint is whole from the start: prompt order
            self._fused_step = self.arrivals.has(step) or step not in self.queue
            self.arrivals.forget_before(step)
        if not self._fused_step:
            if micro == 0:
                self._step_batch = self._take_batch(step)
            return self._step_batch.select(list(range(micro * count, (micro + 1) * count)))
        if micro < micro_batches - 1:
            if self._sync_failure is not None:
                raise self._sync_failure
            t0 = time.perf_counter()
            self._dispatch()
            part = self.arrivals.take(step, count, self.args.rollout_timeout, self._check)
            self.timers["wait"] += time.perf_counter() - t0
            check_logprobs_finite(part)
            return part
        self._step_batch = self._take_batch(step)
        return self.arrivals.rest(self._step_batch)

    def _take_batch(self, step: int) -> RolloutBatch:
        """Rank 0: wait (at most `rollout_timeout`) for batch `step`, regenerating it if it arrived too stale."""
        self.total_steps = max(self.total_steps, step + 1)  # the Trainer may run past max_steps (resume)
        t0 = time.perf_counter()
        if self._sync_failure is not None:
            raise self._sync_failure
        batch = None
        while batch is None and self.partial is not None:
            self._dispatch()
            batch = self.partial.take(step, self.args.rollout_timeout, self._check, self._dispatch)
            self.queue.staleness_counts[step - batch.policy_version] += 1
        while batch is None:
            self._dispatch()
            batch = self.queue.get(step, learner_version=step, timeout=self.args.rollout_timeout, poll=self._check)
            if batch is None:  # arrived too stale: regenerate with the current weights
                self.regenerated += 1
                self._send(step)
        check_logprobs_finite(batch)
        self.timers["wait"] += time.perf_counter() - t0
        self.gen_tokens += batch.num_tokens
        self.gen_seconds += batch.seconds
        return batch

    def after_optimizer_step(self, model, version: int) -> None:
        """Call on every rank after the optimizer step that produced `version`."""
        if version % self.args.sync_every == 0:
            t0 = time.perf_counter()
            state = gather_full_state(model, self.is_main, device=getattr(self.transport, "device", "cpu"))
            t1 = time.perf_counter()
            if self.is_main and self._sync_failure is None:
                try:
                    update = self.transport.publish(state, version)
                except (OSError, WeightTransportError) as exc:  # raised by the next batch_for_step, on every rank
                    self._sync_failure = self._publish_failure(version, exc)
                    logger.error("%s", self._sync_failure)
                else:
                    self.pool.send_weights(update)
                    self.transport.release(self.pool.acks.min_loaded_version())
                    self.queued_version = version
                    self.sync_bytes += update.num_bytes
                    self.syncs += 1
            self.timers["sync_gather"] += t1 - t0
            self.timers["sync_transfer"] += time.perf_counter() - t1
        if self.is_main:
            self._dispatch()
            if self.elastic is not None and self.pool is not None:
                self.elastic.after_step(version, self.timers["wait"], self.queued_version)

    def _check(self) -> None:
        """Rank 0, while it waits for rollouts: a failed generator, an overdue stage or a failed scoring raises."""
        self.pool.check()
        if self.scoring is not None:
            self.scoring.check()

    def _publish_failure(self, version: int, exc: Exception) -> Exception:
        """The failure a publish error becomes: the pool's own account when it has one (a broadcast fails when a
        generator server died: the pool names the server), else the transport's error."""
        try:
            self.pool.check()
        except (GeneratorFailed, StageTimeout) as failure:
            return failure
        return GeneratorFailed(
            f"weight sync: publishing weights v{version} failed ({type(exc).__name__}: {exc}); the generators still "
            f"sample with v{self.queued_version}. If shm_dir is full, free space there or point shm_dir at a larger "
            "RAM-backed directory.")

    # ---- dispatch ----------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        if self.partial is not None:
            self.partial.dispatch(self.queued_version, self.total_steps)
            return
        while self.next_dispatch < self.total_steps and self.queue.admissible(self.next_dispatch, self.queued_version):
            if self.next_dispatch not in self.queue:  # restored from a checkpoint: already generated
                self._send(self.next_dispatch)
            self.next_dispatch += 1

    def _send(self, batch_id: int, indices: list[int] | None = None, attempt: int = 0) -> None:
        """Send batch `batch_id` to the generators (all of them work on every batch, so adding generators cuts the
        latency of each step, which is what matters at low staleness). Streaming: one request per prompt group, each
        to a generator chosen by expected token load (`generator_assignment`, `assignment.py`). Batch-level: one
        contiguous chunk of equal prompt count per generator. `indices` (streaming): only those groups; `attempt` > 0: a
        group regenerated after it arrived too stale (partial rollouts), with seeds of its own."""
        ids = self.stream.prompts_for_step(batch_id)
        active = self.pool.active_generators()  # generator ids; elastic pools change them between batches
        g = len(active)
        self._dispatched_at.setdefault(batch_id, time.perf_counter())
        if self.args.streaming:
            bounds = list(range(len(ids) + 1))
            chunks = list(range(len(ids))) if indices is None else indices
            owners = [active[(batch_id + i) % g] for i in chunks]
            if self.args.generator_assignment == "tokens" and g > 1:
                with self._load_lock:
                    in_flight = [self._in_flight_tokens[k] for k in active]
                owners = [active[j] for j in assign([self._expected_tokens(ids[i]) for i in chunks], in_flight)]
        else:
            num = min(g, len(ids))
            bounds = [round(i * len(ids) / num) for i in range(num + 1)]
            owners = [active[(batch_id + c) % g] for c in range(num)]
            chunks = list(range(num))
        for c, owner in zip(chunks, owners):
            part = ids[bounds[c]:bounds[c + 1]]
            # backends seed sample i of prompt p with seed + p*n + i: offsetting by the chunk's first prompt gives
            # every (batch, prompt, sample) its own stream, reproducible on regeneration and after resume, and the
            # same whether the batch goes whole, in chunks or group by group
            seed = (None if self.settings.seed is None
                    else (self.settings.seed * 1_000_003 + batch_id) * 1_000_003 + bounds[c] * self.settings.n
                    + attempt * 1_000_000_007)
            settings = dataclasses.replace(self.settings, seed=seed)
            request = GenerationRequest(batch_id, part, [self.prompt_token_ids[i] for i in part], settings,
                                        chunk=c, num_chunks=len(bounds) - 1,
                                        max_new_tokens=[self.budgets[i] for i in part] if self.budgets else [])
            expected = sum(self._expected_tokens(i) for i in part)
            with self._load_lock:
                self._in_flight_tokens[owner] += expected
                self._owners.setdefault((batch_id, c), []).append((owner, expected))
            self.pool.send_request(owner, request)

    def _expected_tokens(self, prompt_id: int) -> float:
        return self.settings.n * self.lengths.expected_length(prompt_id) + len(self.prompt_token_ids[prompt_id])

    def _on_rollouts(self, part: RolloutBatch) -> None:
        """Reader thread: reassemble a batch from its parts (chunks or groups), then hand it to the staleness queue.
        The batch's version is the oldest of its parts' (the staleness bound holds for every sample)."""
        with self._load_lock:
            owners = self._owners.get((part.batch_id, part.chunk))
            if owners:  # sent twice when the batch was regenerated: one answer settles one send
                owner, expected = owners.pop(0)
                self._in_flight_tokens[owner] -= expected
            for prompt_id, group in zip(part.prompt_ids, part.completions):
                self.lengths.observe(prompt_id, [len(c.token_ids) for c in group])
                self.length_counts.update(len(c.token_ids) for c in group)
            self._arrived_at[part.batch_id] = time.perf_counter()
            if part.spec:
                self.spec[part.generator_id] = part.spec
        if self.scoring is not None:
            self.scoring.submit(part)  # scored on its thread, which then assembles it
        else:
            self._assemble(part)

    def _assemble(self, part: RolloutBatch) -> bool:
        """Reassemble a batch from its parts; a complete batch goes into the staleness queue (returns True). With
        partial rollouts each group stands alone, waiting for a step to take it."""
        if self.partial is not None:
            self.partial.arrived(part)
            return True
        if self.arrivals is not None:  # before its batch can reach the queue
            self.arrivals.add(part)
        parts = self._partial.setdefault(part.batch_id, {})
        parts[part.chunk] = part
        if len(parts) < part.num_chunks:
            return False
        del self._partial[part.batch_id]
        now, sent, arrived = time.perf_counter(), self._dispatched_at.pop(part.batch_id, None), self._arrived_at.pop(
            part.batch_id, None)
        if sent is not None and arrived is not None:
            self.latency = [self.latency[0] + now - sent, self.latency[1] + now - arrived, self.latency[2] + 1]
        ordered = [parts[c] for c in range(part.num_chunks)]
        if part.num_chunks > 1 and self.pool_size > 1:
            self.imbalance.add(ordered, self.pool_size)
        if part.num_chunks == 1:
            self.queue.put(part)
            return True
        self.queue.put(RolloutBatch.merged(part.batch_id, ordered))
        return True
