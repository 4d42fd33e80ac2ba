"""What our generators add to every vLLM worker: our two weight-transfer backends.

vLLM builds its worker class from `worker_extension_cls` (a qualified name, because the worker may live in another
process), importing this module in the worker before it loads the model. Importing it makes speculative
decoding exact on vLLM's CPU build (`spec_decode_cpu.py`) and registers our backends with
vLLM's factories in that process, which is what lets `LLM(weight_transfer_config={"backend": ...})` (or `vllm serve
--weight-transfer-config`) build them there:
- `async_rlhf_gloo` (`weight_sync/vllm_gloo_engine.py`), what our generators and servers run: the CPU twin of
  vLLM's nccl engine (a gloo group with learner rank 0, packed buckets), which also loads `async_rlhf_shm` updates;
- `async_rlhf_shm` (`weight_sync/vllm_shm_engine.py`): the learner's file in `shm_dir` only.
Either goes through vLLM's native `init_weight_transfer_engine` / `start_weight_update` / `update_weights` /
`finish_weight_update`, i.e. vLLM's layerwise reload.

Why the layerwise reload and not a bare `model.load_weights`: after the first load, vLLM's CPU build post-processes
some layers (the linear weights are repacked for its kernels and lose their `weight_loader`), so a second
`model.load_weights` outside the reload fails with `'Parameter' object has no attribute 'weight_loader'`. The reload
restores each layer's checkpoint-format parameters, loads the HF-named tensors (fusing q/k/v and gate/up as at
start-up), re-runs the post-processing and copies the result into the tensors the kernels already point at. That
reload, not moving the bytes, is where a CPU weight sync spends its time (`benchmarks/weight_broadcast.py`).
"""

from __future__ import annotations

from async_rlhf.generation.engine import spec_decode_cpu
from async_rlhf.weight_sync import vllm_gloo_engine  # noqa: F401  (registers "async_rlhf_gloo" and "async_rlhf_shm")

# vLLM imports this module in `init_worker` right after its platform registered its kernel overrides: replace the
# CPU build's broken expand kernel, without which speculative sampling is not exact there (spec_decode_cpu.py).
spec_decode_cpu.install()


class WeightSyncExtension:
    """Mixed into vLLM's worker class. Adds no method: importing this module is what matters (see above)."""
