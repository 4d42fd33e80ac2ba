"""Which generator pool a run drives, and how its weights reach it: the one place that picks between them.

* `generator_servers`: vLLM servers started elsewhere (`generation/serve.py`), driven over HTTP
  (`http_pool.HTTPGeneratorPool`); weights through shm files that vLLM's weight routes load.
* otherwise local generators (`pool.GeneratorPool`): spawned processes, or Ray actors with
  `generator_launcher='ray'` (`ray_launcher.py`); the pool spawned while the trainer was built is used if it runs
  exactly these generators (`early_start.py`); with `generator_autoscale`, the controller that adds and retires them
  (`elastic.py`). Weights through `weight_sync.make_transport` (shm files, or CUDA IPC when colocated).
"""

from __future__ import annotations

import os
from typing import Callable

from async_rlhf.generation.pool.early_start import adopt_or_close
from async_rlhf.experimental.elastic import make_elastic
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.pipeline.generator_pool import GeneratorPoolProtocol
from async_rlhf.generation.pool.ray_launcher import make_launcher
from async_rlhf.experimental.tail_migration import TailMigration
from async_rlhf.generation.engine.worker import generator_spec, generator_specs
from async_rlhf.types import RolloutBatch
from async_rlhf.weight_sync import ShmWeightTransport, make_transport
from async_rlhf.weight_sync.transport import WeightTransport


def make_pool(args, on_rollouts: Callable[[RolloutBatch], None], model_path: str, engine_kwargs: dict,
              initial_version: int, early_pool: GeneratorPool | None, learners: int, device
              ) -> tuple[WeightTransport, GeneratorPoolProtocol, object | None]:
    """(weight transport, generator pool not started yet, elastic controller or None) for `args`."""
    if args.generator_servers:
        from async_rlhf.generation.pool.http_pool import HTTPGeneratorPool
        from async_rlhf.generation.serve import TOKEN_ENV

        transport = ShmWeightTransport(args.shm_dir)
        pool = HTTPGeneratorPool(
            args.generator_servers, on_rollouts, transport, model_path, initial_version,
            args.generator_start_timeout, args.weight_sync_timeout, request_timeout=args.rollout_timeout,
            token=os.environ.get(TOKEN_ENV, ""), min_model_len=args.max_length, weight_load=args.weight_load)
        return transport, pool, None
    transport = make_transport(args, device)
    specs = generator_specs(args, model_path, engine_kwargs, initial_version)
    pool = adopt_or_close(early_pool, specs, on_rollouts) or GeneratorPool(
        specs, on_rollouts, args.generator_start_timeout, args.weight_sync_timeout, args.generator_max_restarts,
        launcher=make_launcher(args))
    pool.tail = TailMigration(args.tail_migration)
    elastic = make_elastic(args, pool, learners, lambda i, dev: generator_spec(
        args, model_path, engine_kwargs, initial_version, i, dev))
    return transport, pool, elastic
