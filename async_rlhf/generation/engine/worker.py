"""The generator process: one sampling engine, one inbox, one outbox.

Runs in its own OS process (spawned by `generation/pool/local.py`): starts its engine, then serves its inbox with one of
the loops of `serve_loops.py` (batch-level or streaming). Either way a `WeightUpdate` queued before a
`GenerationRequest` is loaded before that request is sampled: this FIFO rule is what lets the learner's admission
control bound staleness without locks. Every rollout carries the version(s) of the weights that sampled it.

Its output goes to `spec.log_path`, with only real problems on the console (`process_log.py`).

How it ends, always (it must never outlive learner rank 0 and hold its engine and device memory forever):
* on `Shutdown` or on any error (after reporting a `GeneratorError`) it closes its engine and leaves with
  `os._exit`: 0 after `Shutdown`, 1 after an error. A plain return would make Python join the outbox's feeder
  thread at exit, which blocks for good when a large rollout is still queued and nobody reads the pipe any more (the
  learner stops reading before it sends `Shutdown`). Only an error report is flushed first, for at most
  `FLUSH_SECONDS` (the learner reads it while it runs);
* when its parent dies: on Linux the kernel SIGKILLs it (`prctl(PR_SET_PDEATHSIG)`, set first thing, so also while
  the engine starts or samples; the parent is the thread that spawned it, which `generation/pool/local.py` keeps to the main thread).
  SIGKILL, because nothing else is sure to end it; the engine is not closed then, its memory (device memory
  included) is freed with the process. Elsewhere it notices within a second while idle and leaves as after
  `Shutdown`;
* it ignores SIGINT and SIGTERM: Ctrl-C and `kill -TERM -<group>` reach the whole process group, and the learner,
  which handles them (checkpoint, then stop), stops its generators itself. `generation/pool/local.py` escalates to SIGKILL.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field

FLUSH_SECONDS = 10.0  # the most an exiting generator waits for its error report to reach the learner
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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
    streaming: bool = False  # request-level serving (`serve_loops.serve_stream`); else batch-level
    weight_load: str = "drain"  # streaming: "drain" | "in_flight" (see `serve_loops.py`)
    stream_engine: type | None = None  # streaming: a `StreamEngine` subclass an optional schedule serves with
    # (chosen in `experimental/schedules.py`), which also builds the backend (`make_backend`); None:
    # `stream_engine.StreamEngine`
    episodes: object | None = None  # an `episodes.EpisodeSpec`: requests with rows are multi-turn episodes


def generator_spec(args, model_path: str, engine_kwargs: dict, initial_version: int, generator_id: int,
                   device: str, stream_engine: type | None = None, episodes=None) -> GeneratorSpec:
    """Generator `generator_id` on `device` (`args`: an `AsyncRLConfig` with its backend already decided)."""
    return GeneratorSpec(generator_id=generator_id, backend=args.generator_backend, model_path=model_path,
                         device=device, seed=args.seed + generator_id, threads=args.generator_threads,
                         engine_kwargs=engine_kwargs, initial_version=initial_version,
                         log_path=os.path.join(args.output_dir, "logs", f"generator-{generator_id}.log"),
                         streaming=args.streaming, weight_load=args.weight_load, stream_engine=stream_engine,
                         episodes=episodes)


def generator_specs(args, model_path: str, engine_kwargs: dict, initial_version: int,
                    stream_engine: type | None = None, episodes=None) -> list[GeneratorSpec]:
    """One spec per entry of `args.generator_devices`."""
    return [generator_spec(args, model_path, engine_kwargs, initial_version, i, device, stream_engine, episodes)
            for i, device in enumerate(args.generator_devices)]


def _restrict_device(device: str, threads: int) -> str:
    """Pin the process to its device before torch/vLLM import CUDA; returns the device name the backend sees."""
    if device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = device.split(":", 1)[1]
        return "cuda"
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return "cpu"


def _die_with_parent(parent) -> None:
    """Linux: have the kernel SIGKILL this process when the thread that started it exits, however it exits: the
    learner's (spawned), or the fork server's (`generation/pool/prewarm.py`), which exits when the learner does."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    real_parent = os.getppid()  # the learner, or the fork server
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no prctl: the idle check in `_serve` still notices the parent's death
        return
    if os.getppid() != real_parent or not parent.is_alive():  # the parent died before the signal was armed
        os._exit(0)


def _leave(outbox, code: int, deliver: bool) -> None:
    """Exit now, without joining the outbox's feeder thread; if `deliver`, first give what is queued (an error
    report) at most FLUSH_SECONDS to reach the parent."""
    if deliver:
        def flush():
            outbox.close()
            outbox.join_thread()

        flusher = threading.Thread(target=flush, daemon=True)
        flusher.start()
        flusher.join(FLUSH_SECONDS)
    outbox.cancel_join_thread()
    # What a normal exit would clean up and `os._exit` skips: multiprocessing's exit-time finalizers, among them the
    # unlinking of semaphores this process created (tqdm's lock, made by vLLM's weight-loading progress bar), which
    # the learner's resource tracker otherwise reports as leaked at its own exit. Bounded, like everything here.
    import multiprocessing.util

    cleaner = threading.Thread(target=multiprocessing.util._run_finalizers, args=(0,), daemon=True)
    cleaner.start()
    cleaner.join(2.0)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


def generator_main(spec: GeneratorSpec, inbox, outbox, environ: dict[str, str] | None = None) -> None:
    """The process's entry point. In a spawned process it never returns (see the module docstring); called in the
    process that owns the queues (tests), it returns like any function and touches no signal. `environ`: the
    environment to run with (a process forked from the warm server, `generation/pool/prewarm.py`: the learner's)."""
    if environ is not None:
        os.environ.clear()
        os.environ.update(environ)
    from multiprocessing import parent_process

    parent = parent_process()
    if parent is not None:
        _die_with_parent(parent)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    from async_rlhf.generation.engine.process_log import route_output

    route_output(spec.log_path, f"generator-{spec.generator_id}")  # before torch and vLLM are imported
    ok = _serve(spec, inbox, outbox)
    if parent is not None:
        _leave(outbox, 0 if ok else 1, deliver=not ok and parent.is_alive())


def _serve(spec: GeneratorSpec, inbox, outbox, where: str = "") -> bool:
    """Serve the inbox until `Shutdown` or the parent's death (True) or an error, reported on `outbox` (False). The
    engine is closed before it returns. `where`: the launcher's name for the place it runs (its `GeneratorReady`)."""
    from multiprocessing import parent_process

    from async_rlhf.generation.engine.serve_loops import serve_batches, serve_stream
    from async_rlhf.types import GeneratorError, GeneratorReady

    device = _restrict_device(spec.device, spec.threads)
    backend = None
    try:
        import torch

        if device == "cpu":
            torch.set_num_threads(spec.threads)
            if spec.engine_kwargs.get("enforce_eager", True):
                # An eager CPU engine compiles one thing: vLLM's token-rank helper (`batched_count_greater_than`, a
                # `torch.compile` that saves GPU memory), on its first sample: 4 s of every generator's start here,
                # 30 s on a machine whose inductor cache is cold. Eager, it computes the same counts.
                torch._dynamo.config.disable = True
        t0 = time.perf_counter()
        if spec.streaming:  # the streaming engine builds the backend it drives (the core's: `load_backend`'s)
            from async_rlhf.generation.engine.stream_engine import StreamEngine

            make_backend = (spec.stream_engine or StreamEngine).make_backend
            backend = make_backend(spec.backend, spec.model_path, device, spec.seed, spec.engine_kwargs)
        else:
            from async_rlhf.generation.engine import load_backend

            backend = load_backend(spec.backend, spec.model_path, device=device, seed=spec.seed,
                                   **spec.engine_kwargs)
        outbox.put(GeneratorReady(spec.generator_id, backend.name, time.perf_counter() - t0, where))
        serve = serve_stream if spec.streaming else serve_batches
        return serve(spec, backend, inbox, outbox, parent_process())
    except BaseException as exc:  # report, then exit: the pool turns this into an error on the learner
        outbox.put(GeneratorError(spec.generator_id, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return False
    finally:
        if backend is not None:
            try:
                backend.close()
            except Exception:
                pass
