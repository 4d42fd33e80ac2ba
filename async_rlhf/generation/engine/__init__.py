"""Code that runs inside a generator process: the sampling engines (`backend.py` the interface, `vllm_backend.py`,
`hf_backend.py`), the process loop (`worker.py`, `serve_loops.py`, `stream_engine.py`) and what vLLM loads into its
workers (`vllm_worker_extension.py`). `load_backend` picks an engine by name; vLLM is imported only when it is
asked for, so the transformers backend works on machines without vLLM."""

from __future__ import annotations

from async_rlhf.generation.engine.backend import GeneratorBackend

BACKENDS = ("vllm", "transformers")


def load_backend(kind: str, model_path: str, device: str = "cpu", seed: int = 0, **engine_kwargs) -> GeneratorBackend:
    """Build the backend `kind` ("vllm" or "transformers") on `model_path`; `engine_kwargs` go to its constructor."""
    if kind == "transformers":
        from async_rlhf.generation.engine.hf_backend import HFBackend

        return HFBackend(model_path, device=device, seed=seed, **engine_kwargs)
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"generator backend 'vllm' needs vLLM, which failed to import ({e}). Install it "
                "(requirements.txt on GPU, requirements-cpu.txt on CPU) or use generator_backend=\"transformers\"."
            ) from e
        from async_rlhf.generation.engine.vllm_backend import VLLMBackend

        return VLLMBackend(model_path, device=device, seed=seed, **engine_kwargs)
    raise ValueError(f"unknown generator backend {kind!r}; valid kinds: {', '.join(BACKENDS)}")
