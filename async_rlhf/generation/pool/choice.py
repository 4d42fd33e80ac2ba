"""Which generator pool a run drives, and how its weights reach it: the one place that picks between them.

* `generator_servers`: vLLM servers started elsewhere (`generation/serve.py`), driven over HTTP
  (`http_pool.HTTPGeneratorPool`); weights through vLLM's weight routes, as shm files for a server that reads
  learner rank 0's `shm_dir` and over the network for one that does not (`weight_sync.network.StateTransport`).
* otherwise local generators (`local.GeneratorPool`): spawned processes, or Ray actors with
  `generator_launcher='ray'` (`ray_launcher.py`: on any node of the cluster, weights over the network, when it has
  nodes besides learner rank 0's; on rank 0's node otherwise); the pool spawned while the trainer was built is used if it runs
  exactly these generators (`early_start.py`). Its generator schedule (`scheduling.py`) is the default unless the
  caller passes another (`experimental/schedules.py`). Where they run and how weights reach them is decided once,
  before the pool is built, into a frozen `GeneratorPlan` (`plan_generators`) that the pool and the transport are made
  from: `weight_sync.make_transport` (shm files, or CUDA IPC when colocated), or, with `weight_transport='network'`
  (or Ray actors that may run on other nodes), a weight group per generator fed by `network_feeds.NetworkFeeds`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from async_rlhf.generation.engine.worker import GeneratorSpec, generator_spec, generator_specs
from async_rlhf.generation.pool.early_start import adopt_or_close
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.generation.pool.ray_launcher import make_launcher
from async_rlhf.generation.pool.scheduling import FixedGenerators, GeneratorScheduling
from async_rlhf.pipeline.generator_pool import GeneratorPoolProtocol
from async_rlhf.types import RolloutBatch
from async_rlhf.weight_sync import make_transport
from async_rlhf.weight_sync.network import StateTransport
from async_rlhf.weight_sync.transport import WeightTransport

# (local pool, spec of a generator to add: (generator id, device) -> spec) -> the run's generator schedule
SchedulingFactory = Callable[[GeneratorPool, Callable[[int, str], GeneratorSpec]], GeneratorScheduling]


def network_options(args) -> dict:
    """`weight_sync.network.NetworkSender`'s options from the config (servers: "backend" follows each server's own
    when `network_backend` is 'auto')."""
    return {"host": args.weight_sync_host, "allow_remote": args.allow_remote, "backend": args.network_engine}


def make_pool(args, on_rollouts: Callable[[RolloutBatch], None], initial_version: int, *, model_path: str,
              engine_kwargs: dict, early_pool: GeneratorPool | None, device,
              scheduling: SchedulingFactory | None = None, stream_engine: type | None = None,
              pool_class: type[GeneratorPool] = GeneratorPool, episodes=None
              ) -> tuple[WeightTransport, GeneratorPoolProtocol, GeneratorScheduling]:
    """(weight transport, generator pool not started yet, generator schedule) for `args`. The first three arguments
    after `args` are the pipeline's (`pipeline/generator_pool.MakePool`); the trainer binds the rest (`scheduling`,
    `stream_engine` and `pool_class`: an optional schedule's, from `experimental/schedules.py`; else the core's;
    `episodes`: the run's `generation/engine/episodes.EpisodeSpec`, when its samples are multi-turn episodes)."""
    if args.generator_servers:
        from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool
        from async_rlhf.generation.serve import TOKEN_ENV

        transport = StateTransport(args.shm_dir)
        pool = HTTPGeneratorPool(
            args.generator_servers, on_rollouts, transport, model_path, initial_version,
            args.generator_start_timeout, args.weight_sync_timeout, request_timeout=args.rollout_timeout,
            token=os.environ.get(TOKEN_ENV, ""), min_model_len=args.max_length, weight_load=args.weight_load,
            weight_transport=args.weight_transport, network={**network_options(args), "backend": args.network_backend})
        return transport, pool, FixedGenerators()
    plan = plan_generators(args, model_path)
    specs = generator_specs(args, model_path, engine_kwargs, initial_version, stream_engine, episodes)
    transport, feeds = weight_route(args, plan, device)
    pool = adopt_or_close(early_pool, specs, on_rollouts, pool_class, plan.weights, feeds) or pool_class(
        specs, on_rollouts, args.generator_start_timeout, args.weight_sync_timeout, args.generator_max_restarts,
        launcher=plan.launcher, weights=plan.weights, feeds=feeds)
    if scheduling is not None:
        pool.scheduling = scheduling(pool, lambda i, dev: generator_spec(
            args, model_path, engine_kwargs, initial_version, i, dev, stream_engine, episodes))
    return transport, pool, pool.scheduling


@dataclass(frozen=True)
class GeneratorPlan:
    """Where a run's local generators run and how their weights reach them, decided once, before the pool is built
    (`plan_generators`); the pool and the weight transport are made from it. The backend (and with it any
    speculation) was decided before, in `args` (`backend_choice.py`, `experimental/schedules.before_spawn`)."""

    launcher: object | None  # a Ray launcher with its placement planned (`ray_launcher.RayLauncher`); None: processes
    weights: str  # 'shm' or 'ipc' (learner rank 0's node), 'network' (anywhere): `config.checks.choose_transport`

    @property
    def network_only(self) -> bool:
        """Every update goes over the network (what ZeRO-3 partitions need: `weight_sync/partitions.py`)."""
        return self.weights == "network"


def plan_generators(args, model_path: str) -> GeneratorPlan:
    """The plan for `args`' local generators: Ray placement (which decides their weights) or processes on this
    host, with the transport `args.local_weight_transport` chose."""
    launcher = make_launcher(args, model_path)  # Ray: decides where the actors may run, and so their weights
    weights = launcher.weights if launcher is not None else args.local_weight_transport
    return GeneratorPlan(launcher, weights)


def weight_route(args, plan: GeneratorPlan, device) -> tuple[WeightTransport, object | None]:
    """(the learner's weight transport, the network feeds the pool opens for each generator or None) for `plan`."""
    if not plan.network_only:
        return make_transport(args, device), None
    from async_rlhf.generation.pool.network_feeds import NetworkFeeds

    transport = StateTransport(args.shm_dir)
    transport.use("network")
    return transport, NetworkFeeds(transport, network_options(args), args.generator_start_timeout +
                                   args.weight_sync_timeout, workers=args.vllm_tensor_parallel_size)
