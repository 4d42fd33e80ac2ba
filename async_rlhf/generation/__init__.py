"""Generator backends. `load_backend` picks one by name; vLLM is imported only when it is asked for, so the
transformers backend (and everything else in the package) works on machines without vLLM."""

from __future__ import annotations

from async_rlhf.generation.backend import GeneratorBackend

BACKENDS = ("vllm", "transformers")


def load_backend(kind: str, model_path: str, device: str = "cpu", seed: int = 0, **engine_kwargs) -> GeneratorBackend:
    """Build the backend `kind` ("vllm" or "transformers") on `model_path`; `engine_kwargs` go to its constructor."""
    if kind == "transformers":
        from async_rlhf.generation.hf_backend import HFBackend

        return HFBackend(model_path, device=device, seed=seed, **engine_kwargs)
    if kind == "vllm":
        try:
            import vllm  # noqa: F401
        except ImportError as e:
            raise ImportError(
                f"generator backend 'vllm' needs vLLM, which failed to import ({e}). Install it "
                "(requirements.txt on GPU, requirements-cpu.txt on CPU) or use generator_backend=\"transformers\"."
            ) from e
        from async_rlhf.generation.vllm_backend import VLLMBackend

        return VLLMBackend(model_path, device=device, seed=seed, **engine_kwargs)
    raise ValueError(f"unknown generator backend {kind!r}; valid kinds: {', '.join(BACKENDS)}")
