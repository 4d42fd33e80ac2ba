"""A grid file (`launch/sweeps/*.yaml`, keys in `GRID_KEYS`, format in docs/sweeps.md), read and validated.

Guarantees: `load_grid` either returns a complete, consistent `Grid` or raises `GridError` naming the file and the
key, before anything starts: unknown keys (with the closest known one), unknown algorithms, recipes the sweep does
not run, missing files, empty or repeated axis values, flags the sweep owns, a flag given both as a flag and an
axis, and every flag name of a recipe under recipes/ against that recipe's own options (launch/sweeping/
recipe_flags.py), e.g. `flags.max_step: not an option of recipes/online_dpo.py (did you mean max_steps?)`. Flag
*values* are left to the recipe, which checks them when its run starts.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field

import yaml

from launch.sweeping import ROOT
from launch.sweeping.recipe_flags import SWEEP_RECIPES, recipe_name, recipe_options

KNOBS = {"num_mini_batches": "N", "max_staleness": "S"}  # knob -> the letter in run names
GRID_KEYS = {
    "description": "free text, shown in the report",
    "algorithms": "name -> recipe path, or name -> {recipe: path, flags: {...}}, or a list of recipes/<name>.py names",
    "num_mini_batches": "values of the paper's N (sync_every = N, max_staleness = N - 1); or give max_staleness",
    "max_staleness": "values of the staleness bound S (0 = synchronous); or give num_mini_batches",
    "seeds": "seeds; each cell runs once per seed",
    "flags": "recipe flags shared by every run (task, max_steps, batch sizes, ...)",
    "axes": "optional extra axes: recipe flag -> list of values (e.g. num_generations: [2, 4])",
    "launcher": "'accelerate' (default: accelerate launch) or 'python'",
    "accelerate_config": "accelerate config file for every run (default: accelerate's own default)",
    "timeout_minutes": "per-run time limit (default 120)",
    "jobs": "runs at a time (default 1; keep 1 when comparing wall-clock times)",
    "gpus_per_run": "GPUs of one run (default 0: runs inherit the sweep's GPUs). Local: each running run gets its own "
                    "CUDA_VISIBLE_DEVICES, jobs x gpus_per_run must fit the visible GPUs; Slurm: the cell's allocation",
    "slurm": "the Slurm backend's resources per cell (keys in SLURM_KEYS; command-line options override them)",
    "estimate": "rough cost of one run, for --dry_run's time estimate before any run of the sweep is measured: "
                "{startup_seconds: s, seconds_per_step: s or {algorithm: s}}",
}
SLURM_KEYS = {  # a grid's `slurm:` mapping; launch/sweeping/slurm.py turns it into a cell's allocation
    "nodes_per_run": "nodes of one cell's allocation (default 1); gpus_per_run is split evenly over them",
    "cpus_per_run": "CPUs of one cell on each of its nodes (sbatch --cpus-per-task; default 1)",
    "mem_gb": "memory of one cell on each of its nodes, GB (sbatch --mem; default: the partition's)",
    "partition": "the partition (default: the cluster's default partition)",
    "account": "the account to charge",
    "sbatch": "further sbatch options, passed through: {option: value} (e.g. {qos: high, constraint: a100})",
    "signal_delay_s": "seconds before the time limit at which a cell checkpoints and is requeued (default 120)",
}
ESTIMATE_KEYS = ("startup_seconds", "seconds_per_step")
ALGORITHM_KEYS = ("recipe", "flags")
OWNED_FLAGS = ("output_dir", "seed", "config")  # set by the sweep for every run
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_]+$")


class GridError(ValueError):
    """The grid file is invalid; the message names the file and the key."""


@dataclass(frozen=True)
class Algorithm:
    name: str
    recipe: str  # absolute path of the recipe script
    flags: dict  # flags of this algorithm only; override the grid's shared flags


@dataclass
class Grid:
    path: str
    algorithms: list[Algorithm]
    knob: str  # "num_mini_batches" or "max_staleness"
    knob_values: list[int]
    seeds: list[int]
    flags: dict
    axes: dict[str, list]
    description: str = ""
    launcher: str = "accelerate"
    accelerate_config: str | None = None
    timeout_minutes: float = 120.0
    jobs: int = 1
    estimate: dict = field(default_factory=dict)  # {"startup_seconds": s, "seconds_per_step": {algorithm: s}}
    gpus_per_run: int = 0
    slurm: dict = field(default_factory=dict)  # keys of SLURM_KEYS, shapes checked here, values by slurm.py
    recipe_options: dict[str, dict | None] = field(default_factory=dict)  # recipe -> {flag: default}; None: unchecked


# ---- the grid file ---------------------------------------------------------------------------------------------
def _fail(path: str, key: str, message: str):
    raise GridError(f"{path}: {key}: {message}")


def _unknown(path: str, where: str, keys, known) -> None:
    bad = [k for k in keys if k not in known]
    if bad:
        hints = [f"{k!r}" + (f" (did you mean {', '.join(difflib.get_close_matches(str(k), known, 3))}?)"
                             if difflib.get_close_matches(str(k), known, 3) else "") for k in bad]
        raise GridError(f"{path}: {where}unknown key(s) {', '.join(hints)}; known: {', '.join(sorted(known))}")


def _distinct_list(path: str, key: str, values, kind=None, minimum=None) -> list:
    if not isinstance(values, list) or not values:
        _fail(path, key, f"must be a non-empty list, got {values!r}")
    for v in values:
        if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
            _fail(path, key, f"values must be integers, got {v!r}")
        if kind is None and not isinstance(v, (str, int, float, bool)):
            _fail(path, key, f"values must be plain numbers, strings or booleans, got {v!r}")
        if minimum is not None and v < minimum:
            _fail(path, key, f"values must be >= {minimum}, got {v}")
    if len(set(map(repr, values))) != len(values):
        _fail(path, key, f"repeated values in {values}")
    return list(values)


def _mapping(path: str, key: str, value) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(path, key, f"must be a mapping of flag: value, got {type(value).__name__}")
    return dict(value)


def _recipe_path(path: str, key: str, recipe) -> str:
    if not isinstance(recipe, str):
        _fail(path, key, f"must be a recipe path, got {recipe!r}")
    full = recipe if os.path.isabs(recipe) else os.path.join(ROOT, recipe)
    if not os.path.isfile(full):
        _fail(path, key, f"recipe {recipe} does not exist")
    return full


def _algorithms(path: str, value) -> list[Algorithm]:
    if isinstance(value, list):
        value = {name: None for name in value}
    if not isinstance(value, dict) or not value:
        _fail(path, "algorithms", "must be a non-empty mapping of name: recipe (or a list of recipe names)")
    known = sorted(SWEEP_RECIPES)
    out = []
    for name, spec in value.items():
        key = f"algorithms.{name}"
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            _fail(path, key, "names may use letters, digits and '_' only (they become directory names)")
        if spec is None:  # a bare name: recipes/<name>.py
            if name not in known and not os.path.isfile(os.path.join(ROOT, "recipes", f"{name}.py")):
                _fail(path, key, f"unknown algorithm: there is no recipes/{name}.py (known: {', '.join(known)}); "
                                 "give `recipe: <path>` for another script")
            spec = {"recipe": f"recipes/{name}.py"}
        elif isinstance(spec, str):
            spec = {"recipe": spec}
        if not isinstance(spec, dict):
            _fail(path, key, f"must be a recipe path or {{recipe: path, flags: {{...}}}}, got {spec!r}")
        _unknown(path, f"{key}: ", spec, ALGORITHM_KEYS)
        if "recipe" not in spec:
            _fail(path, f"{key}.recipe", "missing")
        recipe = _recipe_path(path, f"{key}.recipe", spec["recipe"])
        if recipe_name(recipe) not in (None, *known):  # e.g. recipes/sft.py: no off-policy knob to sweep
            _fail(path, key, f"recipes/{recipe_name(recipe)}.py is not a recipe the sweep runs (those are "
                             f"{', '.join(known)}; launch/sweeping/recipe_flags.py lists them)")
        out.append(Algorithm(name, recipe, _mapping(path, f"{key}.flags", spec.get("flags"))))
    return out


def load_grid(path: str) -> Grid:
    """Read and validate a grid file, flag names included (see the module docstring)."""
    if not os.path.isfile(path):
        raise GridError(f"{path}: grid file does not exist")
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise GridError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise GridError(f"{path}: expected a mapping with keys {', '.join(GRID_KEYS)}")
    _unknown(path, "", raw, GRID_KEYS)
    for key in ("algorithms", "seeds"):
        if key not in raw:
            _fail(path, key, "missing")
    knobs = [k for k in KNOBS if k in raw]
    if len(knobs) != 1:
        _fail(path, "num_mini_batches / max_staleness", f"give exactly one off-policy knob, got {knobs or 'none'}")
    knob = knobs[0]
    grid = Grid(
        path=path,
        algorithms=_algorithms(path, raw["algorithms"]),
        knob=knob,
        knob_values=_distinct_list(path, knob, raw[knob], int, minimum=1 if knob == "num_mini_batches" else 0),
        seeds=_distinct_list(path, "seeds", raw["seeds"], int),
        flags=_mapping(path, "flags", raw.get("flags")),
        axes=_mapping(path, "axes", raw.get("axes")),
        description=str(raw.get("description") or "").strip(),
        launcher=raw.get("launcher", "accelerate"),
        accelerate_config=raw.get("accelerate_config"),
        timeout_minutes=raw.get("timeout_minutes", 120.0),
        jobs=raw.get("jobs", 1),
        gpus_per_run=raw.get("gpus_per_run", 0),
        slurm=_mapping(path, "slurm", raw.get("slurm")),
    )
    for flag, values in grid.axes.items():
        grid.axes[flag] = _distinct_list(path, f"axes.{flag}", values)
    if grid.launcher not in ("accelerate", "python"):
        _fail(path, "launcher", f"{grid.launcher!r} is not 'accelerate' or 'python'")
    if grid.accelerate_config is not None:
        if grid.launcher != "accelerate":
            _fail(path, "accelerate_config", "only used with launcher: accelerate")
        grid.accelerate_config = _recipe_path(path, "accelerate_config", grid.accelerate_config)
    if not isinstance(grid.timeout_minutes, (int, float)) or grid.timeout_minutes <= 0:
        _fail(path, "timeout_minutes", f"must be a number > 0, got {grid.timeout_minutes!r}")
    if not isinstance(grid.jobs, int) or grid.jobs < 1:
        _fail(path, "jobs", f"must be an integer >= 1, got {grid.jobs!r}")
    if not isinstance(grid.gpus_per_run, int) or isinstance(grid.gpus_per_run, bool) or grid.gpus_per_run < 0:
        _fail(path, "gpus_per_run", f"must be an integer >= 0, got {grid.gpus_per_run!r}")
    _unknown(path, "slurm: ", grid.slurm, SLURM_KEYS)
    if "sbatch" in grid.slurm:
        grid.slurm["sbatch"] = _mapping(path, "slurm.sbatch", grid.slurm["sbatch"])
    grid.estimate = _estimate_spec(path, raw.get("estimate"), [a.name for a in grid.algorithms])
    _check_flag_ownership(grid)
    grid.recipe_options = {a.recipe: recipe_options(a.recipe) for a in grid.algorithms}
    _check_flag_names(grid)
    return grid


def _estimate_spec(path: str, value, algorithms: list[str]) -> dict:
    """The grid's `estimate` as {"startup_seconds": s, "seconds_per_step": {algorithm: s}} (empty: none given)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        _fail(path, "estimate", f"must be a mapping with keys {', '.join(ESTIMATE_KEYS)}, got {value!r}")
    _unknown(path, "estimate: ", value, ESTIMATE_KEYS)
    for key in ESTIMATE_KEYS:
        if key not in value:
            _fail(path, f"estimate.{key}", "missing")
    per_step = value["seconds_per_step"]
    if not isinstance(per_step, dict):
        per_step = {name: per_step for name in algorithms}
    _unknown(path, "estimate.seconds_per_step: ", per_step, algorithms)
    missing = [name for name in algorithms if name not in per_step]
    if missing:
        _fail(path, "estimate.seconds_per_step", f"no value for {', '.join(missing)}")
    for key, v in [("startup_seconds", value["startup_seconds"])] + [(f"seconds_per_step.{k}", v)
                                                                      for k, v in per_step.items()]:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
            _fail(path, f"estimate.{key}", f"must be a number >= 0, got {v!r}")
    return {"startup_seconds": float(value["startup_seconds"]),
            "seconds_per_step": {k: float(v) for k, v in per_step.items()}}


def _check_flag_ownership(grid: Grid) -> None:
    """Flags the sweep sets itself, or that would contradict the knob, may not be given by hand."""
    owned = set(OWNED_FLAGS) | set(KNOBS)
    if grid.knob == "num_mini_batches":  # N sets both; an explicit value would conflict (config/base.py rejects it)
        owned |= {"sync_every"}
    for where, flags in [("flags", grid.flags)] + [(f"algorithms.{a.name}.flags", a.flags) for a in grid.algorithms]:
        for key in flags:
            if key in owned:
                _fail(grid.path, f"{where}.{key}", f"set by the sweep (knob {grid.knob}, seeds, output_dir); "
                                                   "remove it from the flags")
            if key in grid.axes:
                _fail(grid.path, f"{where}.{key}", "is also an axis; give it in one place")
    for key in grid.axes:
        if key in owned:
            _fail(grid.path, f"axes.{key}", f"set by the sweep (knob {grid.knob}, seeds, output_dir)")


def _check_flag_names(grid: Grid) -> None:
    for a in grid.algorithms:
        known = grid.recipe_options[a.recipe]
        if known is None:  # a script outside recipes/: it checks its own flags when its run starts
            continue
        rel = os.path.relpath(a.recipe, ROOT)
        for where, keys in (("flags", grid.flags), (f"algorithms.{a.name}.flags", a.flags), ("axes", grid.axes)):
            for key in keys:
                if key not in known:
                    close = difflib.get_close_matches(key, known, 3)
                    _fail(grid.path, f"{where}.{key}", f"not an option of {rel}"
                          + (f" (did you mean {', '.join(close)}?)" if close else ""))
        for key in (grid.knob, "seed", "output_dir"):
            if key not in known:
                _fail(grid.path, f"algorithms.{a.name}", f"{rel} has no --{key} option, which the sweep needs")


