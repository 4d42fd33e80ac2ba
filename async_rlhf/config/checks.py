"""Type, range and path checks of the config fields we declare (`config/base.py`), run first in `__post_init__`, before
any model loads, so a value of the wrong type fails with a `ConfigError` naming the field and the value instead of a
traceback from deep inside the run.

Rules, from each field's declared annotation (`int`, `float | None`, `list[str]`, ...):
* `int` takes an int and nothing else: `True` is not an int here, `1.5` and `"2"` are refused (no silent rounding);
* `float` takes an int or a float (stored as float) that is finite: `inf` and `nan` are refused everywhere (a NaN
  slips through every `>`/`<` range check, and an infinite timeout overflows the waits it reaches);
* `bool` takes only `True`/`False`; `str` only a string; `dict` (and `dict | str`, so that the command line can pass
  JSON) a dict with string keys or its JSON text;
* `list[X]` takes a list of X; a single X is also taken where `__post_init__` accepts one (a comma-separated string
  for `generator_devices` and `generator_servers`, one number for online DPO's `beta`).
Ranges that the type alone cannot say are in `RANGES`. `check_dir` checks a directory we write into exists, is
writable and has room.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import types
import typing

from transformers import TrainingArguments

from async_rlhf.errors import ConfigError


# field -> (predicate, what the value must be)
RANGES = {
    "generator_max_restarts": (lambda v: v >= 0, ">= 0"),
    "vllm_tensor_parallel_size": (lambda v: v >= 1, ">= 1"),
    "vllm_max_model_len": (lambda v: v >= 1, ">= 1 (or None)"),
    "vllm_gpu_memory_utilization": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "max_length": (lambda v: v >= 2, ">= 2"),
    "max_completion_length": (lambda v: v >= 1, ">= 1 (or None)"),
    "max_nonfinite_steps": (lambda v: v >= 0, ">= 0"),
    "gamma": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "lam": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "vf_coef": (lambda v: v >= 0, ">= 0"),
    "cliprange_value": (lambda v: v > 0, "> 0"),
    "shm_dir": (lambda v: v != "", "a directory"),
    "vllm_server_port": (lambda v: 1 <= v <= 65535, "a port number (1-65535)"),
    "vllm_group_port": (lambda v: 1 <= v <= 65535, "a port number (1-65535)"),
    "vllm_server_timeout": (lambda v: v > 0, "> 0 seconds"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1] (or None)"),
    "repetition_penalty": (lambda v: v > 0, "> 0"),
    "generator_autoscale_wait": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "generator_autoscale_idle": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "generator_autoscale_window": (lambda v: v >= 1, ">= 1"),
    "generator_autoscale_cost": (lambda v: v >= 0, ">= 0"),
}
LAUNCHERS = ("process", "ray")
TIMEOUT_FIELDS = ("generator_start_timeout", "rollout_timeout", "weight_sync_timeout")
SINGLE_FOR_LIST = ("generator_devices", "generator_servers", "generator_autoscale_devices", "beta")  # `__post_init__` turns a single value into a list
MIN_FREE_BYTES = 16 << 20  # below this a directory we write weights into is certainly too full


class _Refused(ValueError):
    pass


def own_fields(config) -> dict[str, object]:
    """name -> declared type of every field declared by our config classes (not TrainingArguments')."""
    theirs = {f.name for f in dataclasses.fields(TrainingArguments)}
    hints = typing.get_type_hints(type(config))  # real types: `config/base.py` postpones its annotations
    return {f.name: hints[f.name] for f in dataclasses.fields(config) if f.name not in theirs}


def _convert(value, kind, where: str):
    """`value` checked against the type `kind` (int, float, bool, str, dict, list[X], X | None)."""
    options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    if type(None) in options:
        if value is None:
            return None
        options = tuple(o for o in options if o is not type(None))
    if set(options) == {dict, str}:  # `dict | str`: a dict, or its JSON text from the command line
        options = (dict,)
    (kind,) = options
    if kind is bool:
        if not isinstance(value, bool):
            raise _Refused(f"{where}: expected True or False, got {value!r} ({type(value).__name__})")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Refused(f"{where}: expected an integer, got {value!r} ({type(value).__name__})")
        return value
    if kind is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Refused(f"{where}: expected a number, got {value!r} ({type(value).__name__})")
        if not math.isfinite(value):
            raise _Refused(f"{where}: must be finite, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise _Refused(f"{where}: expected a string, got {value!r} ({type(value).__name__})")
        return value
    if kind is dict:
        if isinstance(value, str):  # a JSON object, as TRL and transformers take dict fields on the command line
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise _Refused(f"{where}: {value!r} is not a JSON object ({exc})") from None
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise _Refused(f"{where}: expected a dict with string keys, got {value!r}")
        return value
    if typing.get_origin(kind) is list:
        if not isinstance(value, list):
            raise _Refused(f"{where}: expected a list, got {value!r} ({type(value).__name__})")
        (item,) = typing.get_args(kind)
        return [_convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where}: no check for type {kind!r}")  # a new field type: add its rule above


def _list_item(kind):
    """list[X] or list[X] | None -> X; anything else -> None."""
    options = typing.get_args(kind) if typing.get_origin(kind) in (typing.Union, types.UnionType) else (kind,)
    lists = [o for o in options if typing.get_origin(o) is list]
    return typing.get_args(lists[0])[0] if lists else None


def check_types(config) -> None:
    """Check (and normalise ints to floats in float fields of) every field we declare; raise ConfigError."""
    for name, kind in own_fields(config).items():
        value = getattr(config, name)
        try:
            item = _list_item(kind)
            if name in SINGLE_FOR_LIST and item is not None and not isinstance(value, list) and value is not None:
                _convert(value, item, name)  # a single value of the item type; `__post_init__` makes the list
                continue
            value = _convert(value, kind, name)
        except _Refused as exc:
            raise ConfigError(str(exc)) from None
        if name in RANGES and value is not None:
            ok, what = RANGES[name]
            if not ok(value):
                raise ConfigError(f"{name}: must be {what}, got {value!r}")
        if name in TIMEOUT_FIELDS and not value > 0:
            raise ConfigError(f"{name}: must be > 0 seconds, got {value!r}")
        setattr(config, name, value)


def check_dir(name: str, path: str, min_free: int = MIN_FREE_BYTES) -> None:
    """`path` (the value of field `name`) is an existing, writable directory with at least `min_free` bytes free."""
    if not os.path.isdir(path):
        raise ConfigError(f"{name}: {path!r} is not an existing directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{name}: {path!r} is not writable by this user")
    free = shutil.disk_usage(path).free
    if free < min_free:
        raise ConfigError(f"{name}: {path!r} has {free / 2**20:.1f} MiB free, needs at least {min_free / 2**20:.1f} "
                          "MiB")


def check_elastic(config) -> None:
    """`generator_launcher` and `generator_autoscale` against the rest: what cannot work is refused before any model
    loads (Ray missing, nothing to add generators on, generators that are not ours to start or stop)."""
    launcher, spare = config.generator_launcher, config.generator_autoscale_devices
    if launcher not in LAUNCHERS:
        raise ConfigError(f"generator_launcher: {launcher!r} is not one of {LAUNCHERS}")
    if launcher == "ray":
        if config.generator_servers:
            raise ConfigError("generator_launcher: 'ray' starts generators as Ray actors; generator_servers are "
                              "started by you. Use one or the other.")
        if not ray_installed():
            raise ConfigError(f"generator_launcher: 'ray' needs Ray, which is not installed here ({RAY_INSTALL_HINT}), "
                              "or use the default 'process'")
    if not config.generator_autoscale:
        if spare:
            raise ConfigError(f"generator_autoscale_devices: {spare} given but generator_autoscale is off; pass "
                              "--generator_autoscale true to let the run add generators on them")
        return
    if config.generator_servers:
        raise ConfigError("generator_autoscale: generator_servers are started and stopped by you, not by the run; "
                          "autoscaling needs generators the run starts (generator_devices)")
    if not spare:
        raise ConfigError("generator_autoscale: no spare device to add a generator on; list them in "
                          "generator_autoscale_devices (e.g. cuda:6 cuda:7, or cpu for another CPU generator)")
    for dev in spare:
        if dev != "cpu" and not (dev.startswith("cuda:") and dev[5:].isdigit()):
            raise ConfigError(f"generator_autoscale_devices: {dev!r} is not 'cpu' or 'cuda:<index>'")
    gpus = [d for d in [*config.generator_devices, *spare] if d != "cpu"]
    if launcher != "ray" and len(set(gpus)) < len(gpus):
        raise ConfigError(f"generator_autoscale_devices: {spare} repeats a GPU of generator_devices "
                          f"{config.generator_devices} or of itself; each generator needs a GPU of its own")
    if config.colocate:
        raise ConfigError("generator_autoscale: not with colocate (colocated generators share the learners' GPUs; "
                          "autoscaling adds generators on devices of their own)")


def check_partial_rollouts(config) -> None:
    """Groups carried across steps keep generating while weights change: only in-flight loads let them (with
    'drain' a weight update would wait behind groups that never stop coming), and only streaming generators
    answer group by group."""
    p = config.partial_rollouts
    if not isinstance(p, int) or p < 0:
        raise ConfigError(f"partial_rollouts: must be an integer >= 0, got {p!r}")
    if not p:
        return
    for ok, what in ((config.max_staleness >= 1, f"max_staleness >= 1 (got {config.max_staleness}: nothing can be "
                                                 "carried past a step)"),
                     (config.generation_mode != "batch" and config.generator_backend != "transformers",
                      f"streaming generators (got generation_mode={config.generation_mode!r}, "
                      f"generator_backend={config.generator_backend!r})"),
                     (config.weight_load == "in_flight", f"weight_load='in_flight' (got {config.weight_load!r}: with "
                                                         "'drain' weights wait for every running group)"),
                     (not config.generator_servers, "local generators (generator_servers is not supported yet)"),
                     (not config.generator_autoscale, "a fixed set of generators (generator_autoscale=True is not "
                                                      "supported with it yet)")):
        if not ok:
            raise ConfigError(f"partial_rollouts: partial_rollouts={p} needs {what}")


def check_generator_servers(config) -> None:
    """Every `generator_servers` entry is an address the HTTP client can reach (scheme, host, port)."""
    for address in config.generator_servers or []:
        try:
            base_url(address)
        except ValueError as exc:
            raise ConfigError(f"generator_servers: {exc}") from None


def check_speculative(config) -> None:
    """`speculative`: a method that can run here (vLLM generators, the package it needs, a draft length in range),
    with weights that load between requests ("in_flight" loads under speculation gave log-probs of neither version
    on vLLM 0.32 CPU, docs/performance.md)."""
    from async_rlhf.speculative import SpeculativeError, check

    try:
        check(config.speculative, config.num_speculative_tokens, config.generator_backend,
              bool(config.generator_servers), config.min_p or 0.0)
    except SpeculativeError as exc:
        raise ConfigError(str(exc)) from None
    if config.speculative != "off" and config.weight_load != "drain":
        raise ConfigError(f"speculative: {config.speculative!r} needs weight_load='drain' (got "
                          f"{config.weight_load!r}): on vLLM 0.32 a sample running when weights load under speculation "
                          "continues with log-probs of neither version; set weight_load='drain' or speculative='off'")


def check_tail_migration(config) -> None:
    """A hand-over continues samples on another engine: local streaming vLLM generators that load weights in flight
    (each token's version is then known wherever it was sampled), at least two of them, none added or retired."""
    t = config.tail_migration
    if not isinstance(t, int) or t < 0:
        raise ConfigError(f"tail_migration: must be an integer >= 0, got {t!r}")
    if not t:
        return
    for ok, what in ((len(config.generator_devices) >= 2, f"at least 2 generator_devices (got "
                                                          f"{len(config.generator_devices)})"),
                     (config.generation_mode != "batch" and config.generator_backend != "transformers",
                      f"streaming generators (got generation_mode={config.generation_mode!r}, "
                      f"generator_backend={config.generator_backend!r})"),
                     (config.weight_load == "in_flight", f"weight_load='in_flight' (got {config.weight_load!r})"),
                     (not config.generator_servers, "local generators (not generator_servers)"),
                     (not config.generator_autoscale, "a fixed set of generators (not generator_autoscale)"),
                     (not config.partial_rollouts, "partial_rollouts=0 (the two are not combined yet)")):
        if not ok:
            raise ConfigError(f"tail_migration: tail_migration={t} needs {what}")


def check_train_while_generating(config) -> None:
    """Micro-batches taken in arrival order need more than one of them per step, and batches that are a step's own."""
    if not config.train_while_generating:
        return
    if config.gradient_accumulation_steps < 2:
        raise ConfigError(
            f"train_while_generating: needs gradient_accumulation_steps >= 2 (got "
            f"{config.gradient_accumulation_steps}): a step's micro-batches are what trains while the rest of its batch "
            f"is generated. Keep the prompts per step and split them, e.g. per_device_train_batch_size "
            f"{max(1, config.per_device_train_batch_size // 4)} with gradient_accumulation_steps "
            f"{4 * config.gradient_accumulation_steps}")
    if config.partial_rollouts:
        raise ConfigError(f"train_while_generating: not with partial_rollouts={config.partial_rollouts} (a partial "
                          "step's groups come from several batches; the two are not combined yet)")
    if getattr(config, "loss_type", None) in ("dapo", "cispo"):
        raise ConfigError(f"train_while_generating: not with loss_type={config.loss_type!r}, whose denominator is the "
                          "whole step's token count, unknown while the step's first micro-batches train")


def comma_list(value):
    """'a,b' or ['a,b'] or ['a', 'b'] -> ['a', 'b'] (list fields accept comma- and space-separated values alike).
    Anything that is not text is left as it is, for the type check to name."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        return value
    out = []
    for entry in value:
        out.extend(p.strip() for p in entry.split(",") if p.strip()) if isinstance(entry, str) else out.append(entry)
    return out


RAY_INSTALL_HINT = "pip install -r requirements-ray.txt"


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None



def base_url(address: str) -> str:
    """'host:port' or 'http(s)://host:port' -> 'http(s)://host:port'. Raises ValueError for anything else."""
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "http", address
    if scheme not in ("http", "https"):
        raise ValueError(f"generator server {address!r}: scheme must be http or https")
    host, colon, port = rest.rstrip("/").rpartition(":")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
        raise ValueError(f"generator server {address!r}: expected host:port (e.g. node7:8000)")
    return f"{scheme}://{host}:{port}"
