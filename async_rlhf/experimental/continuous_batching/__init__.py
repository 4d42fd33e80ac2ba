"""transformers' continuous batching as a generator engine (`continuous_batching`; TRL 1.16's
`use_transformers_continuous_batching` with `transformers_continuous_batching_config`): streaming generators without
vLLM, each sample answered as it finishes, behaviour log-probs for every token, weights loaded between decode steps
(`weight_load='in_flight'`, per-token versions) or once the running samples drain (`'drain'`). Not measured faster
than the transformers static-batch generator anywhere yet (`benchmarks/continuous_batching.py` measures it), so it
stays here and `generator_backend='auto'` never picks it.

Whole here, reached from the core only through the streaming engine's extension points
(`generation/engine/stream_engine.py`: `make_backend`, `begin`, `load_weights` and the rest):
- `backend.py`: `ContinuousBatchingBackend`, the policy sampled by transformers' `ContinuousBatchingManager` (its
  settings, cache size, log-probs, what it refuses, and what its seeds do and do not reproduce);
- `engine.py`: `ContinuousBatchingEngine`, the `StreamEngine` a generator serves with (`GeneratorSpec.stream_engine`),
  which keeps each sample's tokens and versions and restarts running samples over their context after a load.
Which runs get it: `experimental/schedules.py`; its fields and checks: `config/experimental.py`, `config/checks.py`.
"""

from async_rlhf.experimental.continuous_batching.backend import ContinuousBatchingBackend
from async_rlhf.experimental.continuous_batching.engine import ContinuousBatchingEngine

__all__ = ["ContinuousBatchingBackend", "ContinuousBatchingEngine"]
