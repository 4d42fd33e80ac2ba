"""Type, range and path checks of the config fields we declare (`config/base.py` and the mixins of its fields, one
module per concern), run first in `__post_init__`, before any model loads, so a value of the wrong type fails with a
`ConfigError` naming the field and the value instead of a traceback from deep inside the run.

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
import ipaddress
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


GENERATOR_BACKENDS = ("auto", "vllm", "transformers")
GENERATION_MODES = ("auto", "stream", "batch")
WEIGHT_LOADS = ("drain", "in_flight")
ASSIGNMENTS = ("tokens", "count")
REWARD_FAILURE_POLICIES = ("raise", "skip")
ROLLOUT_TIMEOUT_MARGIN = 60  # seconds: rank 0 publishes weights and dispatches before it starts waiting for rollouts


def require(condition: bool, field_name: str, message: str) -> None:
    """Raise `ConfigError("<field>: <message>")` unless `condition`."""
    if not condition:
        raise ConfigError(f"{field_name}: {message}")


def check_ranges(config) -> None:
    """Every range and choice of `AsyncRLConfig`'s own fields, and the relations between them (after `check_types`
    and the `num_mini_batches` derivation); each error names the field and the values at stake."""
    require(isinstance(config.max_staleness, int) and config.max_staleness >= 0, "max_staleness",
            f"must be an integer >= 0, got {config.max_staleness!r}")
    require(config.sync_every >= 1, "sync_every", f"must be >= 1, got {config.sync_every}")
    require(config.sync_every <= config.max_staleness + 1, "sync_every",
            f"sync_every={config.sync_every} with max_staleness={config.max_staleness}: weights that change only "
            f"every {config.sync_every} steps can never be fresh enough. Use sync_every <= max_staleness + 1.")
    for name, allowed in (("generator_backend", GENERATOR_BACKENDS), ("generation_mode", GENERATION_MODES),
                          ("weight_load", WEIGHT_LOADS), ("generator_assignment", ASSIGNMENTS),
                          ("reward_failure", REWARD_FAILURE_POLICIES)):
        require(getattr(config, name) in allowed, name, f"{getattr(config, name)!r} is not one of {allowed}")
    require(len(config.generator_devices) >= 1, "generator_devices", "needs at least one device")
    for dev in config.generator_devices:
        require(dev == "cpu" or (dev.startswith("cuda:") and dev[5:].isdigit()), "generator_devices",
                f"{dev!r} is not 'cpu' or 'cuda:<index>'")
    require(config.num_generations >= config.min_generations, "num_generations",
            f"must be >= {config.min_generations} for {type(config).__name__}, got {config.num_generations}")
    require(config.max_new_tokens >= 1, "max_new_tokens", f"must be >= 1, got {config.max_new_tokens}")
    require(config.max_new_tokens < config.max_length, "max_new_tokens",
            f"max_new_tokens={config.max_new_tokens} must be < max_length={config.max_length} (prompt needs room)")
    require(config.temperature >= 0, "temperature", f"must be >= 0, got {config.temperature}")
    require(0 < config.top_p <= 1, "top_p", f"must be in (0, 1], got {config.top_p}")
    require(config.top_k >= 0, "top_k", f"must be >= 0, got {config.top_k}")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # other ranks wait for rank 0's rollouts in a collective
        require(config.rollout_timeout + ROLLOUT_TIMEOUT_MARGIN <= config.ddp_timeout, "rollout_timeout",
                f"rollout_timeout={config.rollout_timeout:g} s with ddp_timeout={config.ddp_timeout} s: learner "
                f"ranks other than 0 wait for the rollouts inside a collective that fails after ddp_timeout, so "
                f"rollout_timeout must be at most ddp_timeout - {ROLLOUT_TIMEOUT_MARGIN} s. Raise ddp_timeout "
                "or lower rollout_timeout.")
    require(config.save_total_limit != 1, "save_total_limit",
            "1 would delete the last valid checkpoint while the next one is being written; use >= 2 or None")
    require(config.generator_threads >= 1, "generator_threads", f"must be >= 1, got {config.generator_threads}")
    require(config.learner_threads is None or config.learner_threads >= 1, "learner_threads",
            f"must be >= 1 or None, got {config.learner_threads}")


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
    """`generator_launcher`, `generator_autoscale` and their devices, each on its own (combinations: `UNSUPPORTED`)."""
    launcher = config.generator_launcher
    if launcher not in LAUNCHERS:
        raise ConfigError(f"generator_launcher: {launcher!r} is not one of {LAUNCHERS}")
    if launcher == "ray" and not ray_installed():
        raise ConfigError(f"generator_launcher: 'ray' needs Ray, which is not installed here ({RAY_INSTALL_HINT}), "
                          "or use the default 'process'")
    for dev in config.generator_autoscale_devices:
        if dev != "cpu" and not (dev.startswith("cuda:") and dev[5:].isdigit()):
            raise ConfigError(f"generator_autoscale_devices: {dev!r} is not 'cpu' or 'cuda:<index>'")
    gpus = [d for d in [*config.generator_devices, *config.generator_autoscale_devices] if d != "cpu"]
    if config.generator_autoscale and launcher != "ray" and len(set(gpus)) < len(gpus):
        raise ConfigError(f"generator_autoscale_devices: {config.generator_autoscale_devices} repeats a GPU of "
                          f"generator_devices {config.generator_devices} or of itself; each generator needs a GPU of "
                          "its own")


STALENESS_BOUNDS = ("oldest", "newest")


def check_staleness_bound(config) -> None:
    """The 'newest' rule lets a group outlive max_staleness steps while it keeps sampling on fresh weights: only
    partial rollouts keep a group open across steps (a batch tied to its step gains nothing from it); its second
    cap, on the oldest token, defaults to twice max_staleness and cannot be below it."""
    if config.staleness_bound not in STALENESS_BOUNDS:
        raise ConfigError(f"staleness_bound: {config.staleness_bound!r} is not one of {STALENESS_BOUNDS}")
    cap = config.max_oldest_staleness
    if config.staleness_bound == "oldest":
        if cap is not None:
            raise ConfigError(f"max_oldest_staleness: {cap} is only used with staleness_bound='newest' (got "
                              f"staleness_bound='oldest', whose cap on every token is max_staleness="
                              f"{config.max_staleness})")
        return
    if not config.partial_rollouts:
        raise ConfigError(f"staleness_bound: 'newest' needs partial_rollouts >= 1 (got partial_rollouts="
                          f"{config.partial_rollouts}: a batch tied to its step cannot outlive max_staleness)")
    if cap is None:
        config.max_oldest_staleness = cap = 2 * config.max_staleness
    if not isinstance(cap, int) or cap < config.max_staleness:
        raise ConfigError(f"max_oldest_staleness: must be an integer >= max_staleness={config.max_staleness}, "
                          f"got {cap!r}")


# transformers' ContinuousBatchingConfig values the continuous-batching generators need (why:
# experimental/continuous_batching/backend.py); a continuous_batching_config asking otherwise is refused
CONTINUOUS_BATCHING_FORCED = {"return_logprobs": True, "allow_block_sharing": False, "use_async_batching": False,
                              "cpu_offload_space": 0.0}


def check_continuous_batching(config) -> None:
    """`continuous_batching`: transformers' streaming generators. Settles generator_backend and generation_mode where
    they are 'auto' (to 'transformers' and 'stream': the option names its engine, nothing to measure), refuses what
    the engine cannot serve, and checks `continuous_batching_config` against transformers' ContinuousBatchingConfig."""
    if not config.continuous_batching:
        return
    if config.generator_servers:
        raise ConfigError("continuous_batching: generator_servers are vLLM servers; continuous batching runs in the "
                          "run's own generator processes (drop generator_servers or continuous_batching)")
    if config.generator_backend == "auto":
        config.generator_backend = "transformers"
    if config.generator_backend != "transformers":
        raise ConfigError(f"continuous_batching: transformers' continuous batching is a transformers engine, but "
                          f"generator_backend={config.generator_backend!r}; use generator_backend='transformers' "
                          "(or 'auto'), or continuous_batching=False")
    if config.generation_mode == "auto":
        config.generation_mode = "stream"
    if config.generation_mode != "stream":
        raise ConfigError(f"continuous_batching: its generators answer each prompt group as it finishes (the "
                          f"streaming path), but generation_mode={config.generation_mode!r}; use generation_mode="
                          "'stream' (or 'auto')")
    if config.repetition_penalty != 1.0:
        raise ConfigError(f"continuous_batching: transformers' continuous batching drops the repetition penalty (its "
                          f"processors see only each sequence's last token), got repetition_penalty="
                          f"{config.repetition_penalty}; use repetition_penalty=1 or continuous_batching=False")
    given = config.continuous_batching_config or {}
    from transformers.generation import ContinuousBatchingConfig

    known = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    unknown = sorted(set(given) - known)
    if unknown:
        raise ConfigError(f"continuous_batching_config: {unknown} are not fields of transformers' "
                          f"ContinuousBatchingConfig (valid: {sorted(known)})")
    clash = {k: v for k, v in given.items() if k in CONTINUOUS_BATCHING_FORCED and v != CONTINUOUS_BATCHING_FORCED[k]}
    if clash:
        raise ConfigError(f"continuous_batching_config: {clash} would break the generators' guarantees (behaviour "
                          f"log-probs, exact versions after a weight load); these are fixed at "
                          f"{CONTINUOUS_BATCHING_FORCED}")


def check_generator_servers(config) -> None:
    """Every `generator_servers` entry is an address the HTTP client can reach (scheme, host, port)."""
    for address in config.generator_servers or []:
        try:
            base_url(address)
        except ValueError as exc:
            raise ConfigError(f"generator_servers: {exc}") from None


def check_counts(config) -> None:
    """`partial_rollouts` and `tail_migration` are integers >= 0 (0: off)."""
    for name in ("partial_rollouts", "tail_migration"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"{name}: must be an integer >= 0, got {value!r}")


def check_speculative(config) -> None:
    """`speculative`: a method that can run here (vLLM generators, the package it needs, a draft length in range),
    with weights that load between requests ("in_flight" loads under speculation gave log-probs of neither version
    on vLLM 0.32 CPU, docs/performance.md)."""
    from async_rlhf.config.speculative import SpeculativeError, check

    try:
        check(config.speculative, config.num_speculative_tokens, config.generator_backend,
              bool(config.generator_servers), config.min_p or 0.0)
    except SpeculativeError as exc:
        raise ConfigError(str(exc)) from None
    if config.speculative != "off" and config.weight_load != "drain":
        raise ConfigError(f"speculative: {config.speculative!r} needs weight_load='drain' (got "
                          f"{config.weight_load!r}): on vLLM 0.32 a sample running when weights load under speculation "
                          "continues with log-probs of neither version; set weight_load='drain' or speculative='off'")






WEIGHT_TRANSPORTS = ("auto", "shm", "ipc", "network")
NETWORK_BACKENDS = ("gloo", "nccl")


def is_loopback(host: str) -> bool:
    """The one rule for what counts as loopback (server binds, weight groups)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def choose_transport(setting: str, who: str, *, same_gpu: bool, sees_shm: bool) -> str:
    """The weight transport generator `who` gets for `weight_transport=setting`: with 'auto', CUDA IPC on learner rank
    0's own GPU, shm where it can read rank 0's `shm_dir`, the network otherwise; a forced one that cannot work is a
    ValueError naming the generator (see `weight_sync/network.py`)."""
    if setting not in WEIGHT_TRANSPORTS:
        raise ValueError(f"weight_transport: {setting!r} is not one of {WEIGHT_TRANSPORTS}")
    if setting == "auto":
        return "ipc" if same_gpu else "shm" if sees_shm else "network"
    if setting == "ipc" and not same_gpu:
        raise ValueError(f"weight_transport='ipc' but {who} does not run on learner rank 0's GPU")
    if setting == "shm" and not sees_shm:
        raise ValueError(f"weight_transport='shm' but {who} cannot read learner rank 0's shm_dir (another host, or "
                         "a private /dev/shm): use weight_transport='network' or 'auto'")
    return setting


def check_weight_transport(config) -> None:
    """`weight_transport`, `network_backend`, `weight_sync_host` and `allow_remote` agree with each other and with
    the generators."""
    if config.weight_transport not in WEIGHT_TRANSPORTS:
        raise ConfigError(f"weight_transport: {config.weight_transport!r} is not one of {WEIGHT_TRANSPORTS}")
    if config.network_backend not in ("auto",) + NETWORK_BACKENDS:
        raise ConfigError(f"network_backend: {config.network_backend!r} is not one of {('auto',) + NETWORK_BACKENDS}")
    if not is_loopback(config.weight_sync_host) and not config.allow_remote:
        raise ConfigError(f"weight_sync_host: {config.weight_sync_host!r} is not a loopback address; set "
                          "allow_remote=True to let generators on other machines join weight groups (gloo and NCCL "
                          "authenticate nobody: use a private network)")
    if config.generator_servers:
        if config.weight_transport == "ipc":
            raise ConfigError("weight_transport: 'ipc' needs generators on learner rank 0's GPU; generator_servers "
                              "are separate servers (use 'auto', 'shm' or 'network')")
        return
    if config.weight_transport == "network" and config.generator_backend == "transformers":
        raise ConfigError("weight_transport: 'network' needs vLLM generators (generator_backend='transformers' loads "
                          "shm or ipc updates only)")
    try:
        config.local_weight_transport
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


# ---- option combinations ---------------------------------------------------------------------------------------
# The one rule: a combination that does not work is refused before anything loads, with a message that names both
# options, what each was set to, and what to change; nothing is switched off silently. Each row: (option, the
# setting it cannot go with, clash(config) -> True when asked for, why, what to change (text, or a function of the
# config)). Rows whose `with` is a
# learner setting (DeepSpeed, LoRA) are checked by the trainer, which knows them (`LEARNER_UNSUPPORTED`).

def _streams(c) -> bool:
    return c.generation_mode != "batch" and c.generator_backend != "transformers"


def _to_streams(c) -> str:
    """What makes a run's generators stream: the backend when it is transformers (continuous batching included),
    else the mode."""
    if c.generator_backend == "transformers":
        return ("use generator_backend='vllm' with generation_mode='stream' (transformers' generators, continuous "
                "batching included, return whole samples)")
    return "use generation_mode='stream'"


def _value(config, name: str) -> str:
    return repr(getattr(config, name)) if hasattr(config, name) else "set"


UNSUPPORTED = [
    ("generation_mode", "generator_backend",
     lambda c: (c.generation_mode == "stream" and c.generator_backend == "transformers" and not c.generator_servers
                and not c.continuous_batching),
     "'stream' needs vLLM or transformers' continuous batching (transformers' generate samples whole batches)",
     "use generator_backend='vllm', continuous_batching=True or generation_mode='batch'"),
    ("partial_rollouts", "max_staleness", lambda c: c.partial_rollouts and c.max_staleness < 1,
     "nothing can be carried past a step at max_staleness 0", "set max_staleness >= 1"),
    ("partial_rollouts", "generation_mode", lambda c: c.partial_rollouts and not _streams(c),
     "only streaming generators answer group by group", _to_streams),
    ("partial_rollouts", "weight_load", lambda c: c.partial_rollouts and c.weight_load != "in_flight",
     "with 'drain' a weight update waits behind groups that never stop coming", "use weight_load='in_flight'"),
    ("partial_rollouts", "generator_servers", lambda c: c.partial_rollouts and c.generator_servers,
     "not built for servers yet", "use local generators (generator_devices) or partial_rollouts=0"),
    ("partial_rollouts", "generator_autoscale", lambda c: c.partial_rollouts and c.generator_autoscale,
     "the two are not combined yet", "turn one of them off"),
    ("tail_migration", "generator_devices", lambda c: c.tail_migration and len(c.generator_devices) < 2,
     "a hand-over needs at least two generators", "list 2 or more generator_devices, or tail_migration=0"),
    ("tail_migration", "generation_mode", lambda c: c.tail_migration and not _streams(c),
     "only streaming vLLM generators hand samples over", _to_streams),
    ("tail_migration", "weight_load", lambda c: c.tail_migration and c.weight_load != "in_flight",
     "each moved token keeps its version only with in-flight loads", "use weight_load='in_flight'"),
    ("tail_migration", "generator_servers", lambda c: c.tail_migration and c.generator_servers,
     "hand-overs are between the run's own generator processes", "use local generators or tail_migration=0"),
    ("tail_migration", "generator_autoscale", lambda c: c.tail_migration and c.generator_autoscale,
     "a run has one generator schedule", "turn one of them off"),
    ("tail_migration", "partial_rollouts", lambda c: c.tail_migration and c.partial_rollouts,
     "the two are not combined yet", "turn one of them off"),
    ("train_while_generating", "gradient_accumulation_steps",
     lambda c: c.train_while_generating and c.gradient_accumulation_steps < 2,
     "a step's micro-batches are what trains while the rest of its batch is generated",
     lambda c: (f"keep the prompts per step and split them, e.g. per_device_train_batch_size "
                f"{max(1, c.per_device_train_batch_size // 4)} with gradient_accumulation_steps "
                f"{4 * c.gradient_accumulation_steps}")),
    ("train_while_generating", "partial_rollouts", lambda c: c.train_while_generating and c.partial_rollouts,
     "a run has one batch schedule", "turn one of them off"),
    ("train_while_generating", "loss_type",
     lambda c: c.train_while_generating and getattr(c, "loss_type", None) in ("dapo", "cispo"),
     "its denominator is the whole step's token count, unknown while the first micro-batches train",
     "use loss_type 'grpo', 'bnpo' or 'dr_grpo', or train_while_generating=False"),
    ("generator_launcher", "generator_servers", lambda c: c.generator_launcher == "ray" and c.generator_servers,
     "'ray' starts generators as Ray actors; servers are started by you", "use one or the other"),
    ("generator_autoscale", "generator_servers", lambda c: c.generator_autoscale and c.generator_servers,
     "servers are started and stopped by you, not by the run", "use generator_devices, or generator_autoscale=False"),
    ("generator_autoscale", "generator_autoscale_devices",
     lambda c: bool(c.generator_autoscale) != bool(c.generator_autoscale_devices),
     "spare devices are what autoscaling adds generators on",
     "give both (e.g. --generator_autoscale true --generator_autoscale_devices cpu) or neither"),
    ("generator_autoscale", "colocate", lambda c: c.generator_autoscale and c.colocate,
     "colocated generators share the learners' GPUs", "use generator devices of their own, or colocate=False"),
    ("reference_while_generating", "score_while_generating",
     lambda c: c.reference_while_generating and c.score_while_generating is False,
     "the reference runs on the thread that scores parts as they arrive", "set score_while_generating=True"),
]

# learner settings the config cannot see: (option, learner setting, clash(config, deepspeed, lora), why, change)
LEARNER_UNSUPPORTED = [
    ("score_while_generating", "DeepSpeed", lambda c, ds, lora: ds and c.score_while_generating,
     "a partitioned reward model needs every rank for each forward", "leave score_while_generating unset (auto)"),
    ("split_forwards", "DeepSpeed", lambda c, ds, lora: ds and c.split_forwards,
     "DeepSpeed's engines expect one forward per backward", "leave split_forwards unset (auto)"),
    ("reference_while_generating", "DeepSpeed", lambda c, ds, lora: ds and c.reference_while_generating,
     "it runs on rank 0's scoring thread, which DeepSpeed learners do not have",
     "set reference_while_generating=False"),
    ("reference_while_generating", "a LoRA policy", lambda c, ds, lora: lora and c.reference_while_generating,
     "a LoRA policy's reference is the policy with adapters off, not a frozen model",
     "set reference_while_generating=False"),
]


def check_combinations(config) -> None:
    """Refuse the first combination of `UNSUPPORTED` the config asks for (see the table's comment)."""
    for option, other, clash, why, change in UNSUPPORTED:
        if clash(config):
            change = change(config) if callable(change) else change
            raise ConfigError(f"{option}={_value(config, option)} cannot go with {other}={_value(config, other)}: "
                              f"{why}; {change}")


def check_learner_combinations(config, deepspeed: bool, lora: bool) -> None:
    """`LEARNER_UNSUPPORTED`, checked by the trainer before it loads or starts anything of its own."""
    for option, other, clash, why, change in LEARNER_UNSUPPORTED:
        if clash(config, deepspeed, lora):
            raise ConfigError(f"{option}={_value(config, option)} cannot go with {other}: {why}; {change}")


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
