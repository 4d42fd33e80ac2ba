"""The generator process: one sampling engine, one inbox, one outbox.

Runs in its own OS process (spawned by `generation/pool.py`). It serves its inbox strictly in order, so a
`WeightUpdate` queued before a `GenerationRequest` is always loaded before that request is sampled: this FIFO
order is what lets the learner's admission control bound staleness without locks. Every rollout is tagged with
the version of the weights loaded when it was sampled.

Its output goes to `spec.log_path`, with only real problems on the console (`process_log.py`).
The process exits on `Shutdown`, on any error (after reporting a `GeneratorError`), or when its parent dies
(checked every second), so it can never be orphaned.
"""

from __future__ import annotations

import os
import queue
import time
import traceback
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GeneratorSpec:
    """Everything a generator process needs to start (plain values: it crosses a spawn boundary)."""

    generator_id: int
    backend: str  # "vllm" | "transformers"
    model_path: str  # directory with config + weights for version 0
    device: str  # "cpu" | "cuda:<i>"
    seed: int
    threads: int
    engine_kwargs: dict = field(default_factory=dict)
    initial_version: int = 0
    log_path: str | None = None  # the process's whole output (see `process_log.py`); None: console only


def _restrict_device(device: str, threads: int) -> str:
    """Pin the process to its device before torch/vLLM import CUDA; returns the device name the backend sees."""
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        return "cuda"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return "cpu"


def generator_main(spec: GeneratorSpec, inbox, outbox) -> None:
    from multiprocessing import parent_process

    from async_rlhf.generation.process_log import route_output

    route_output(spec.log_path, f"generator-{spec.generator_id}")  # before torch and vLLM are imported
    from async_rlhf.types import GenerationRequest, GeneratorError, GeneratorReady, RolloutBatch, WeightAck

    device = _restrict_device(spec.device, spec.threads)
    backend = None
    try:
        import torch

        if device == "cpu":
            torch.set_num_threads(spec.threads)
        from async_rlhf.generation import load_backend

        t0 = time.perf_counter()
        backend = load_backend(spec.backend, spec.model_path, device=device, seed=spec.seed, **spec.engine_kwargs)
        version = spec.initial_version
        outbox.put(GeneratorReady(spec.generator_id, backend.name, time.perf_counter() - t0))
        parent = parent_process()
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if msg.kind == "shutdown":
                return
            if msg.kind == "weights":
                t0 = time.perf_counter()
                backend.load_weights(msg)
                version = msg.version
                outbox.put(WeightAck(spec.generator_id, version, time.perf_counter() - t0))
            elif msg.kind == "generate":
                assert isinstance(msg, GenerationRequest)
                t0 = time.perf_counter()
                completions = backend.generate(msg.prompt_token_ids, msg.settings)
                outbox.put(
                    RolloutBatch(
                        batch_id=msg.batch_id,
                        generator_id=spec.generator_id,
                        policy_version=version,
                        prompt_ids=msg.prompt_ids,
                        prompt_token_ids=msg.prompt_token_ids,
                        completions=completions,
                        seconds=time.perf_counter() - t0,
                        chunk=msg.chunk,
                        num_chunks=msg.num_chunks,
                    )
                )
            else:
                raise ValueError(f"generator {spec.generator_id}: unknown message kind {msg.kind!r}")
    except BaseException as exc:  # report, then exit: the pool turns this into an error on the learner
        outbox.put(GeneratorError(spec.generator_id, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if backend is not None:
            try:
                backend.close()
            except Exception:
                pass
