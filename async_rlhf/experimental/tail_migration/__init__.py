"""Tail migration (`tail_migration`; RLHFuse's migration of long-tailed samples): when few prompt groups of a batch
are still generating and they are spread over several generators, hand them all to one of them, so that the others
serve the next admitted batches alone rather than keeping a few long samples each.

Whole here, reached from the core only through its declared extension points:
- `policy.py`: the rule and its counters, a generator schedule (`pipeline/generator_pool.GeneratorScheduling`) that
  the local pool calls under its lock with a `RequestBook` (the requests in flight, an inbox to put into, a request
  to move);
- `messages.py`: `TailHandoff` (learner -> generator), `Migrated` (generator -> learner) and `ContinuedRequest`
  (a request with each sample as it stood on its first generator), which travel only between local processes;
- `engine.py`: `HandoffEngine`, the `StreamEngine` a generator serves with (`GeneratorSpec.stream_engine`), which
  notes every step's tokens so that a request can be handed over mid-sample and continued elsewhere.
Which runs get it: `experimental/schedules.py`; options that cannot go with it are refused by `config/checks.py`.

Experimental because it has not paid where measured: 0.99x-1.11x of streaming on 2 CPU cores, the 1.11x not
repeated; no GPU measurement (it needs vLLM; docs/performance.md, Verdicts).
"""

from async_rlhf.experimental.tail_migration.engine import HandoffEngine, joined
from async_rlhf.experimental.tail_migration.messages import ContinuedRequest, Migrated, TailHandoff
from async_rlhf.experimental.tail_migration.policy import TailMigration

__all__ = ["ContinuedRequest", "HandoffEngine", "Migrated", "TailHandoff", "TailMigration", "joined"]
