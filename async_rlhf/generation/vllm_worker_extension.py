"""The path our documentation and earlier releases give vLLM as `--worker-extension-cls`
(`async_rlhf.generation.vllm_worker_extension.WeightSyncExtension`); the code is in `engine/vllm_worker_extension.py`."""

from async_rlhf.generation.engine.vllm_worker_extension import WeightSyncExtension  # noqa: F401
