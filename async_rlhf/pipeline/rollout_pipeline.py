"""The asynchronous rollout pipeline: wires prompts -> generators -> staleness queue -> learner -> weights.

This is the one place that owns processes and threads. On learner rank 0 it holds the generator pool (generator
processes + a reader thread, or servers; `generation/pool/`, built by the `make_pool` it is given), the
`StalenessQueue`, the weight transport, the generator schedule (`generation/pool/scheduling.py`) and the batch
schedule (`batch_forming.py`); other ranks hold nothing and receive each step's rollouts from rank 0 by broadcast.

Step protocol, per optimizer step b (every learner rank calls both, in this order):
1. `batch_for_step(b)`: rank 0 waits (at most `rollout_timeout`) for batch b, checks its staleness
   (version >= b - max_staleness, else drops and regenerates it), and broadcasts it to all ranks. With
   `partial_rollouts` the batch is instead the first finished groups within the bound
   (`experimental/partial_rollouts.py`, which also applies `staleness_bound="newest"`: newest token >= b -
   max_staleness, oldest >= b - max_oldest_staleness).
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

from async_rlhf.errors import GeneratorFailed, RewardError, StageTimeout, WeightTransportError
from async_rlhf.pipeline.assignment import LengthEstimator, assign
from async_rlhf.pipeline.batch_forming import MakeBatchForming, PipelineAccess, WholeBatches
from async_rlhf.pipeline.generator_pool import GeneratorPoolProtocol, GeneratorScheduling, MakePool
from async_rlhf.pipeline.prompt_stream import PromptStream
from async_rlhf.pipeline.rank_share import check_logprobs_finite, share_batch
from async_rlhf.pipeline.records import PipelineRecords
from async_rlhf.pipeline.staleness_queue import StalenessQueue
from async_rlhf.scoring.stage import ScoringStage
from async_rlhf.types import GenerationRequest, RolloutBatch, SamplingSettings
from async_rlhf.weight_sync import gather_full_state
from async_rlhf.weight_sync.gather import is_zero3_partitioned
from async_rlhf.weight_sync.partitions import PartitionStore
from async_rlhf.weight_sync.transport import WeightTransport

logger = logging.getLogger(__name__)

FAILED_CLOSE_SECONDS = 2.0  # a failed run's generators: this long to stop (no acknowledgement awaited), then killed


class RolloutPipeline:
    def __init__(self, args, prompt_token_ids: list[list[int]], generator_model_path: str, accelerator,
                 total_steps: int, settings: SamplingSettings, make_pool: MakePool | None = None,
                 score: list[tuple[str, Callable[[list[RolloutBatch]], list[RolloutBatch]]]] | None = None,
                 budgets: list[int] | None = None,
                 batch_forming: MakeBatchForming = WholeBatches, rows: list[dict] | None = None):
        """`make_pool(on_rollouts, initial_version)`: (weight transport, generator pool not started yet, generator
        schedule) for this run, on rank 0 (`generation/pool/choice.py`, bound by the trainer).
        `score`: the stages that score a part on rank 0 as it arrives (`scoring/stage.py`); None: the learner
        scores batches.
        `budgets`: each prompt's own `max_new_tokens` (a dataset column, `data/prompts.py`); None: the settings'.
        `batch_forming`: the batch schedule (`batch_forming.py`), built with what it may use of this pipeline.
        `rows`: each prompt's dataset row when its samples are multi-turn episodes (`GenerationRequest.rows`)."""
        self.args = args
        self.accelerator = accelerator
        self.is_main = accelerator.is_main_process
        self.prompt_token_ids = prompt_token_ids
        self.stream = PromptStream(len(prompt_token_ids), args.prompts_per_step, args.seed)
        self.total_steps = total_steps
        self.settings = settings
        self.generator_model_path = generator_model_path
        self._make_pool = make_pool
        self.queue = StalenessQueue(args.max_staleness)
        self.records = PipelineRecords()
        self.pool: GeneratorPoolProtocol | None = None
        self.scheduling: GeneratorScheduling | None = None  # the generator schedule, from `make_pool`
        self.transport: WeightTransport | None = None
        self.queued_version = 0  # newest weights sent to the generators (derived: see the module docstring)
        self._sync_failure: GeneratorFailed | None = None  # a failed publish, raised by the next batch_for_step
        self._score = score
        self.scoring: ScoringStage | None = None
        self.budgets = budgets
        self.rows = rows
        self.lengths = LengthEstimator(settings.max_new_tokens, budgets)  # observed by the reader thread, read by dispatch
        self.pool_size = 0  # generators, once started
        self._in_flight_tokens = collections.defaultdict(float)  # generator -> expected tokens sent, not returned
        self._owners: dict[tuple[int, int], list] = {}  # (batch, part) -> [(generator, expected tokens)] per send
        self._load_lock = threading.Lock()  # the two above: dispatch (main thread) and the reader thread
        self.forming = batch_forming(PipelineAccess(
            queue=self.queue, records=self.records, send=self.send, check=self.check, take_whole=self.take_whole,
            queued_version=lambda: self.queued_version, total_steps=lambda: self.total_steps,
            pool_size=lambda: self.pool_size, rollout_timeout=args.rollout_timeout))
        self._step_batch: RolloutBatch | None = None  # the current step's whole batch (see `micro_batch`)
        self._partitions: PartitionStore | None | bool = None  # `_partition_store`: None undecided, False not used

    @property
    def regenerated(self) -> int:
        return self.records.regenerated

    # ---- lifecycle ---------------------------------------------------------------------------------------
    def start(self, initial_version: int = 0, pending: list[RolloutBatch] = (), counters: dict | None = None) -> None:
        """Start the generators at `initial_version` (> 0 when resuming: the generators then start from the
        checkpoint's weights), with rollouts restored from a checkpoint already queued."""
        self.queued_version = initial_version
        if not self.is_main:
            return
        self.records.restore_counters(self.queue, counters or {})
        self.forming.restore(initial_version, list(pending), counters or {})
        if initial_version >= self.total_steps:  # resumed from the final checkpoint: nothing left to generate
            return
        if self._score is not None:
            self.scoring = ScoringStage(self._score, self._assemble)
        self.transport, self.pool, self.scheduling = self._make_pool(self._on_rollouts, initial_version)
        try:
            self.pool.start()
        except BaseException:
            self.close()
            raise
        self.records.start_seconds = self.pool.start_seconds
        self.records.start_wait_seconds = self.pool.start_wait_seconds
        self.pool_size = self.pool.num_generators
        self.forming.dispatch()

    def pending(self, step: int) -> list[RolloutBatch]:
        """Rollouts generated but not trained yet, for a checkpoint at `step`."""
        return self.forming.pending(step)

    def counters(self) -> dict:
        """What a checkpoint saves of the pipeline (`async_rlhf_pipeline.json`)."""
        return {**self.records.counters(self.queue), **self.forming.counters(), "batch_forming": self.forming.name}

    def stats(self) -> dict[str, float]:
        """Cumulative pipeline metrics (meaningful on rank 0)."""
        out = self.records.stats(self.queue)
        if self.pool is not None:
            self.records.pool_state(self.pool)
            out["generator/version_loaded"] = float(self.pool.acks.min_loaded_version())
            out["sync/load_seconds"] = self.records.load_seconds
            out["generator/busy_seconds"] = self.records.busy_seconds
        if self.transport is not None:
            out.update(self.transport.stats())
        for part in (self.scheduling, self.forming, self.scoring):
            if part is not None:
                out.update(part.stats())
        return out

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ended on an error, so no acknowledgement is awaited and the generators get
        FAILED_CLOSE_SECONDS to stop before they are killed (a stopped or stalled one would otherwise hold the error
        back for the pool's full grace periods)."""
        for part in (self.scheduling, self.forming):
            if part is not None:
                self.records.schedule_summary.update(part.summary())
        if self.pool is not None:
            # first: it may still record the acknowledgements of the last weights
            if failed:
                self.pool.close(FAILED_CLOSE_SECONDS)
            else:
                self.pool.close()
            self.records.pool_state(self.pool)
            self.records.pending_versions = self.pool.acks.pending()  # sent, never acknowledged (close waited)
            self.pool = None
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        if self._partitions:  # after the pool: its last sends gather from every rank
            self._partitions.close(wait=0.0 if failed else self.args.weight_sync_timeout + 30.0)
            self._partitions = False
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
        per rank, rank r's at rows [r * per, (r + 1) * per). Its slice of the whole batch in prompt order (one
        broadcast per step), or what the batch schedule forms for it (`per_micro_batch`: one broadcast each). After
        the last one, `trained_batch` is the step's whole batch (rank 0)."""
        count = self.args.groups_per_micro_batch * self.accelerator.num_processes
        if not self.forming.per_micro_batch:
            if micro == 0:
                self._step_batch = self.batch_for_step(step)
            return self._step_batch.select(list(range(micro * count, (micro + 1) * count)))
        return self._on_every_rank(lambda: self._take_micro(step, micro, micro_batches, count))

    def describe(self, batch: RolloutBatch) -> dict:
        """What the batch schedule adds to the record of a trained batch (`trained_batches.jsonl`); {}: nothing."""
        return self.forming.describe(batch)

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
        """Rank 0: micro-batch `micro` of step `step`, as the batch schedule forms it."""
        self.total_steps = max(self.total_steps, step + 1)
        if self._sync_failure is not None:
            raise self._sync_failure
        return self.forming.take_micro(step, micro, micro_batches, count)

    def take_whole(self, step: int) -> RolloutBatch:
        """Rank 0: batch `step` as the batch schedule forms it, checked and counted (also the last micro-batch's
        wait of a schedule that forms micro-batches; it sets `trained_batch`)."""
        self._step_batch = self._take_batch(step)
        return self._step_batch

    def _take_batch(self, step: int) -> RolloutBatch:
        """Rank 0: wait (at most `rollout_timeout`) for batch `step`, as the batch schedule forms it."""
        self.total_steps = max(self.total_steps, step + 1)  # the Trainer may run past max_steps (resume)
        t0 = time.perf_counter()
        if self._sync_failure is not None:
            raise self._sync_failure
        batch = self.forming.take(step)
        check_logprobs_finite(batch)
        self.records.batch_taken(batch, time.perf_counter() - t0)
        return batch

    def after_optimizer_step(self, model, version: int) -> None:
        """Call on every rank after the optimizer step that produced `version`."""
        timers = self.records.timers
        if version % self.args.sync_every == 0:
            t0 = time.perf_counter()
            partitions = self._partition_store(model)
            if partitions is not None:  # ZeRO-3 on the network: each rank keeps its partitions, no gather now
                state = partitions.take(version)
            else:
                state = gather_full_state(model, self.is_main,
                                          device=self.transport.device if self.transport is not None else "cpu")
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
                    self.records.sync_bytes += update.num_bytes
                    self.records.syncs += 1
            timers["sync_gather"] += t1 - t0
            timers["sync_transfer"] += time.perf_counter() - t1
        if self.is_main:
            self.forming.dispatch()
            if self.pool is not None:
                self.scheduling.after_step(version, timers["wait"], self.queued_version)

    def _partition_store(self, model) -> PartitionStore | None:
        """Every rank, at the first sync: a `PartitionStore` when the policy is ZeRO-3 partitioned and every generator
        takes the network (`weight_transport="network"`, or "auto" where rank 0's transport carries only network
        updates: servers on other hosts, Ray actors across nodes), else None (the full state is gathered to rank 0).
        Every rank decides alike (rank 0's view is broadcast), since opening it is a collective."""
        if self._partitions is False:
            return None
        if self._partitions is None:
            import torch.distributed as dist

            use = (self.args.weight_transport in ("network", "auto") and is_zero3_partitioned(model)
                   and dist.is_initialized() and dist.get_world_size() > 1)
            if use and self.args.weight_transport == "auto":
                view = [bool(self.is_main and self.transport.network_only())]
                dist.broadcast_object_list(view, src=0)
                use = view[0]
            if not use:
                self._partitions = False
                return None
            try:
                self._partitions = PartitionStore.open(model, self.args.weight_sync_timeout)
            except ValueError as exc:  # raised alike on every rank, before any collective
                if self.is_main:
                    logger.warning("weights: gathering the whole state at each sync, not keeping partitions: %s", exc)
                self._partitions = False
                return None
            if self.is_main:
                self.transport.use_partitions(self._partitions)
        return self._partitions

    def check(self) -> None:
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
    def send(self, batch_id: int, indices: list[int] | None = None, attempt: int = 0) -> None:
        """Send batch `batch_id` to the generators (all of them work on every batch, so adding generators cuts the
        latency of each step, which is what matters at low staleness). Streaming: one request per prompt group, each
        to a generator chosen by expected token load (`generator_assignment`, `assignment.py`). Batch-level: one
        contiguous chunk of equal prompt count per generator. `indices` (streaming): only those groups; `attempt` > 0: a
        group regenerated after it arrived too stale, with seeds of its own."""
        ids = self.stream.prompts_for_step(batch_id)
        active = self.pool.active_generators()  # generator ids; a generator schedule may change them between batches
        g = len(active)
        self.records.dispatched(batch_id)
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
                                        max_new_tokens=[self.budgets[i] for i in part] if self.budgets else [],
                                        rows=[self.rows[i] for i in part] if self.rows else [])
            expected = sum(self._expected_tokens(i) for i in part)
            with self._load_lock:
                self._in_flight_tokens[owner] += expected
                self._owners.setdefault((batch_id, c), []).append((owner, expected))
            self.pool.send_request(owner, request)

    def _expected_tokens(self, prompt_id: int) -> float:
        return self.settings.n * self.lengths.expected_length(prompt_id) + len(self.prompt_token_ids[prompt_id])

    def _on_rollouts(self, part: RolloutBatch) -> None:
        """Reader thread: settle the part's expected load, record it, then score it (on the scoring thread) or
        hand it to the batch schedule."""
        with self._load_lock:
            owners = self._owners.get((part.batch_id, part.chunk))
            if owners:  # sent twice when the batch was regenerated: one answer settles one send
                owner, expected = owners.pop(0)
                self._in_flight_tokens[owner] -= expected
            for prompt_id, group in zip(part.prompt_ids, part.completions):
                self.lengths.observe(prompt_id, [len(c.token_ids) for c in group])
        self.records.part_arrived(part)
        if self.scoring is not None:
            self.scoring.submit(part)  # scored on its thread, which then assembles it
        else:
            self._assemble(part)

    def _assemble(self, part: RolloutBatch) -> bool:
        """A (scored) part goes to the batch schedule; True when it completed a batch (`ScoringStage` calls this)."""
        return self.forming.arrived(part)
