"""How off-policy can I go, and what does it buy me? One command: a grid of recipe runs, then a table and plots.

    python launch/sweep.py --quick --output_dir outputs/sweep_quick                # toy task, a few minutes on CPU
    python launch/sweep.py --config launch/sweeps/paper_ablation.yaml --output_dir outputs/paper_ablation
    python launch/sweep.py --config launch/sweeps/async_vs_sync.yaml --output_dir outputs/async_vs_sync --dry_run
    python evals/aggregate.py outputs/paper_ablation                               # table and plots again

A grid file (`launch/sweeps/*.yaml`, keys in `GRID_KEYS` below, format in docs/sweeps.md) names the algorithms
(each a recipe), the values of the off-policy knob (`num_mini_batches`, the paper's N, or `max_staleness`), the
seeds, the recipe flags every run shares, and optional extra axes (any recipe flag). Every cell of
{algorithm} x {knob} x {extra axes} x {seed} is one `accelerate launch` (or `python`) of its recipe.

Guarantees:
- the grid is validated completely before anything starts: unknown keys, unknown algorithms, empty or repeated axis
  values, flags the recipe does not have, flags the sweep owns; each error names the file and the key;
- a run lives in `DIR/runs/<name>/`, its name encodes its cell (`online_dpo-N4-seed1`); the sweep writes there the
  run's `config.yaml` (every recipe flag of that cell; the recipe is started with `--config` on it), `log.txt`
  (its stdout and stderr) and `sweep_run.json` (cell, command, status, exit code, seconds); the recipe writes
  `metrics.jsonl`, `run_summary.json`, the model and, when its task evaluates, `eval_results.json`;
- a run is finished when `run_summary.json` exists (and `eval_results.json`, when the task evaluates): finished
  runs are skipped; any other run directory is emptied and the run started again. A finished run whose recorded
  flags differ from the grid's is an error before anything starts (its results would silently mix two settings);
- a run that fails or outlives its timeout is reported with its log and error line; the others still run. The
  exit code is 1 when any run did not finish;
- each run is its own process group: a timeout, Ctrl-C or SIGTERM sends it SIGTERM (the recipe checkpoints and
  stops), then SIGKILL after `--grace_seconds`; a second Ctrl-C kills at once. The sweep then exits with 130;
- `--dry_run` writes nothing: it prints the plan and a time estimate (per run: start-up + max_steps x seconds per
  step, measured on this sweep's finished runs of the same algorithm, else the grid's `estimate`).
Exit codes: 0 every run finished, 1 some run failed or timed out, 2 invalid grid (nothing ran), 130 interrupted.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `python launch/sweep.py` from a checkout: evals/ sits next to launch/
    sys.path.insert(0, ROOT)

from evals.aggregate import aggregate  # noqa: E402
from evals.run_result import run_finished  # noqa: E402

QUICK_GRID = os.path.join(ROOT, "launch", "sweeps", "quick.yaml")
DEFAULT_GRID = os.path.join(ROOT, "launch", "sweeps", "paper_ablation.yaml")
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
    "estimate": "rough cost of one run, for --dry_run's time estimate before any run of the sweep is measured: "
                "{startup_seconds: s, seconds_per_step: s or {algorithm: s}}",
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
    recipe_options: dict[str, dict] = field(default_factory=dict)  # recipe -> {flag: default}


@dataclass(frozen=True)
class Run:
    """One cell x seed: everything needed to start it and to recognise it later."""

    name: str
    algorithm: str
    recipe: str
    knob: str
    knob_value: int
    seed: int
    axes: dict  # extra-axis flag -> value
    flags: dict  # every recipe flag of this run except output_dir (written to its config.yaml)
    expects_eval: bool  # the task writes eval_results.json (the built-in task with eval_prompts > 0)
    index: int = 0  # position in the grid (the table and plots keep the grid's order)


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
    known = sorted(f[:-3] for f in os.listdir(os.path.join(ROOT, "recipes")) if f.endswith(".py"))
    out = []
    for name, spec in value.items():
        key = f"algorithms.{name}"
        if not isinstance(name, str) or not NAME_PATTERN.match(name):
            _fail(path, key, "names may use letters, digits and '_' only (they become directory names)")
        if spec is None:  # a bare name: recipes/<name>.py
            if name not in known:
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
        out.append(Algorithm(name, _recipe_path(path, f"{key}.recipe", spec["recipe"]),
                             _mapping(path, f"{key}.flags", spec.get("flags"))))
    return out


def load_grid(path: str, check_recipes: bool = True) -> Grid:
    """Read and validate a grid file. `check_recipes` also checks every flag name against the recipe's own options
    (it imports each recipe in a short-lived subprocess: a few seconds)."""
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
    grid.estimate = _estimate_spec(path, raw.get("estimate"), [a.name for a in grid.algorithms])
    _check_flag_ownership(grid)
    if check_recipes:
        grid.recipe_options = recipe_options(sorted({a.recipe for a in grid.algorithms}))
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
    if grid.knob == "num_mini_batches":  # N sets both; an explicit value would conflict (config.py rejects it)
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


_RECIPE_OPTIONS_CODE = r"""
import dataclasses, importlib.util, json, sys
out = {}
for i, path in enumerate(sys.argv[1:]):
    spec = importlib.util.spec_from_file_location(f"sweep_recipe_{i}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(module)
    options = {}
    for obj in vars(module).values():  # the dataclasses a recipe parses: ScriptArguments and its config class
        if isinstance(obj, type) and dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                d = f.default
                options[f.name] = d if isinstance(d, (str, int, float, bool, type(None))) else None
    out[path] = options
print("RECIPE_OPTIONS " + json.dumps(out))
"""


_OPTIONS_CACHE: dict[tuple[str, float], dict] = {}  # (recipe path, mtime) -> options, for this process


def recipe_options(recipes: list[str]) -> dict[str, dict]:
    """{recipe path: {flag: default}} for each recipe: the fields of the dataclasses it parses. Read in a subprocess
    so the sweep process stays small (no torch) while its runs go; one subprocess reads every recipe under
    recipes/ at once (they share their imports), and the answers are kept for this process."""
    def key(path):
        return path, os.path.getmtime(path)

    missing = [r for r in recipes if key(r) not in _OPTIONS_CACHE]
    if missing:
        shipped = os.path.join(ROOT, "recipes")
        siblings = sorted(os.path.join(shipped, f) for f in os.listdir(shipped) if f.endswith(".py")) if all(
            os.path.dirname(r) == shipped for r in missing) else []
        batch = list(dict.fromkeys(missing + [p for p in siblings if key(p) not in _OPTIONS_CACHE]))
        proc = subprocess.run([sys.executable, "-c", _RECIPE_OPTIONS_CODE, *batch], cwd=ROOT, capture_output=True,
                              text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RECIPE_OPTIONS ")), None)
        if proc.returncode != 0 or line is None:
            if len(batch) > len(missing):  # a broken sibling recipe must not block a grid that does not use it
                proc = subprocess.run([sys.executable, "-c", _RECIPE_OPTIONS_CODE, *missing], cwd=ROOT,
                                      capture_output=True, text=True, timeout=300,
                                      env={**os.environ, "HF_HUB_OFFLINE": "1"})
                line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RECIPE_OPTIONS ")),
                            None)
            if proc.returncode != 0 or line is None:
                raise GridError(f"could not read the options of {', '.join(missing)}:\n{proc.stderr[-3000:]}")
        for path, opts in json.loads(line[len("RECIPE_OPTIONS "):]).items():
            _OPTIONS_CACHE[key(path)] = opts
    options = {r: _OPTIONS_CACHE[key(r)] for r in recipes}
    for recipe, opts in options.items():
        if not opts:
            raise GridError(f"{recipe}: no argument dataclasses at module level; the sweep cannot check its flags")
    return options


# ---- the runs of a grid ----------------------------------------------------------------------------------------
def _label(value) -> str:
    return re.sub(r"[^A-Za-z0-9_.]+", "_", str(value)).strip("_") or "x"


def expand(grid: Grid) -> list[Run]:
    """Every run of the grid, in order: algorithm, knob value, extra axes, seed."""
    import itertools

    runs = []
    axis_names = list(grid.axes)
    for a in grid.algorithms:
        defaults = grid.recipe_options.get(a.recipe, {})
        for value in grid.knob_values:
            for combo in itertools.product(*(grid.axes[k] for k in axis_names)):
                axes = dict(zip(axis_names, combo))
                for seed in grid.seeds:
                    name = "-".join([a.name, f"{KNOBS[grid.knob]}{value}"]
                                    + [f"{k}{_label(v)}" for k, v in axes.items()] + [f"seed{seed}"])
                    flags = {**grid.flags, **a.flags, **axes, grid.knob: value, "seed": seed}
                    runs.append(Run(name, a.name, a.recipe, grid.knob, value, seed, axes, flags,
                                    _expects_eval(flags, defaults), index=len(runs)))
    names = [r.name for r in runs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:  # e.g. axis values 'a/b' and 'a_b' both label as a_b
        raise GridError(f"{grid.path}: axes: runs would share directory names {duplicates}")
    return runs


def _expects_eval(flags: dict, defaults: dict) -> bool:
    """async_rlhf/tasks.py: only the built-in task evaluates (eval_results.json), and only with eval_prompts > 0."""
    if "task" not in defaults:
        return False
    return flags.get("task", defaults["task"]) == "builtin" and (flags.get("eval_prompts", defaults.get("eval_prompts"))
                                                                or 0) > 0


def command(grid: Grid, run: Run, run_dir: str) -> list[str]:
    config = os.path.join(run_dir, "config.yaml")
    if grid.launcher == "python":
        return [sys.executable, run.recipe, "--config", config]
    # `python -m accelerate.commands.launch` is `accelerate launch` of this very interpreter
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    if grid.accelerate_config:
        launch += ["--config_file", grid.accelerate_config]
    return launch + [run.recipe, "--config", config]


def _record(run_dir: str) -> dict | None:
    try:
        with open(os.path.join(run_dir, "sweep_run.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_record(run_dir: str, record: dict) -> None:
    tmp = os.path.join(run_dir, "sweep_run.json.tmp")
    with open(tmp, "w") as f:
        json.dump(record, f, indent=2)
    os.replace(tmp, os.path.join(run_dir, "sweep_run.json"))


def _rel(path: str) -> str:
    """Recipe paths are recorded relative to the checkout, so a moved checkout still recognises its runs."""
    rel = os.path.relpath(path, ROOT)
    return path if rel.startswith("..") else rel


def _still_running(run_dir: str, record: dict) -> int | None:
    """The process group of an earlier sweep's run that is still alive (that sweep was killed), else None."""
    pgid = record.get("pgid") if record.get("status") == "running" else None
    if not pgid:
        return None
    try:
        with open(f"/proc/{pgid}/cmdline", "rb") as f:  # the group leader is the launcher we started
            alive = run_dir.encode() in f.read()
    except OSError:
        return None
    return pgid if alive else None


def check_run_dirs(runs: list[Run], runs_dir: str, grid_path: str) -> None:
    """Before anything starts. A finished run made with other flags would be skipped and silently mixed into this
    grid's table: refuse. A run directory the sweep did not make, or whose run is still going (an earlier sweep
    was killed), would be emptied on retry: refuse too."""
    changed = []
    for run in runs:
        run_dir = os.path.join(runs_dir, run.name)
        record = _record(run_dir)
        if record is None:
            if os.path.isdir(run_dir) and os.listdir(run_dir):
                raise GridError(f"{run_dir} exists but was not made by the sweep (no sweep_run.json); move it away")
            continue
        pgid = _still_running(run_dir, record)
        if pgid:
            raise GridError(f"{run.name} is still running from an earlier sweep (process group {pgid}); wait for it "
                            f"or stop it with `kill -- -{pgid}`, then rerun")
        if not run_finished(run_dir, run.expects_eval):
            continue
        old = record.get("flags", {})
        diff = sorted(k for k in set(old) | set(run.flags) if old.get(k) != run.flags.get(k))
        if diff or record.get("recipe") != _rel(run.recipe):
            changed.append(f"  {run.name}: " + (", ".join(f"{k} {old.get(k)!r} -> {run.flags.get(k)!r}" for k in diff)
                                               or f"recipe {record.get('recipe')} -> {_rel(run.recipe)}"))
    if changed:
        raise GridError(f"{grid_path}: these runs finished earlier with different settings:\n" + "\n".join(changed)
                        + f"\nUse another --output_dir, or delete those directories under {runs_dir} to rerun them.")


# ---- the plan and its cost ---------------------------------------------------------------------------------------
def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _measured(runs_dir: str) -> dict[str, dict]:
    """{algorithm: {"startup_seconds", "seconds_per_step", "runs"}} from the finished runs in runs_dir: start-up is
    everything but the training loop (imports, generator start, save, final evaluation)."""
    samples: dict[str, list[tuple[float, float]]] = {}
    for record_path in glob.glob(os.path.join(runs_dir, "*", "sweep_run.json")):
        run_dir = os.path.dirname(record_path)
        record = _record(run_dir)
        if not record or record.get("status") != "finished" or not record.get("seconds"):
            continue
        try:
            with open(os.path.join(run_dir, "run_summary.json")) as f:
                summary = json.load(f)
        except (OSError, ValueError):
            continue
        loop, steps = summary.get("loop_seconds") or 0.0, summary.get("steps") or 0
        if steps > 0 and 0 < loop <= record["seconds"]:
            samples.setdefault(record["algorithm"], []).append((record["seconds"] - loop, loop / steps))
    return {alg: {"startup_seconds": sum(s for s, _ in xs) / len(xs),
                  "seconds_per_step": sum(p for _, p in xs) / len(xs), "runs": len(xs)} for alg, xs in samples.items()}


def estimate(grid: Grid, runs: list[Run], runs_dir: str) -> tuple[float | None, list[str]]:
    """(seconds of wall time for the runs still to go, or None when unknown; lines explaining it). Per run:
    start-up + max_steps x seconds per step, from this sweep's finished runs of the same algorithm when there are
    some, else from the grid's `estimate`; divided by `jobs` for runs at a time."""
    measured = _measured(runs_dir)
    todo = [r for r in runs if not run_finished(os.path.join(runs_dir, r.name), r.expects_eval)]
    if not todo:
        return 0.0, ["  nothing to run"]
    per_run, unknown, lines = [], [], []
    for algorithm in dict.fromkeys(r.algorithm for r in todo):
        mine = [r for r in todo if r.algorithm == algorithm]
        if algorithm in measured:
            m = measured[algorithm]
            startup, per_step = m["startup_seconds"], m["seconds_per_step"]
            source = f"measured on {m['runs']} finished run(s) here"
        elif grid.estimate:
            startup, per_step = grid.estimate["startup_seconds"], grid.estimate["seconds_per_step"][algorithm]
            source = f"the grid's `estimate` in {os.path.basename(grid.path)}"
        else:
            unknown.append(algorithm)
            continue
        steps = [r.flags.get("max_steps", grid.recipe_options.get(r.recipe, {}).get("max_steps")) for r in mine]
        if not all(isinstance(n, int) and n > 0 for n in steps):
            unknown.append(f"{algorithm} (no max_steps)")
            continue
        seconds = [startup + n * per_step for n in steps]
        per_run += seconds
        lines.append(f"  {algorithm}: {len(mine)} run(s) x ~{_duration(sum(seconds) / len(mine))} "
                     f"({startup:.0f} s start-up + max_steps x {per_step:.2g} s; {source})")
    if unknown:
        lines.append(f"  no estimate for {', '.join(unknown)}: give the grid an `estimate` "
                     "(startup_seconds, seconds_per_step), or run one cell first with --only")
    slots = [0.0] * min(grid.jobs, len(todo))  # runs start in order, each on the first free slot
    for seconds in per_run:
        slots[slots.index(min(slots))] += seconds
    bound = math.ceil(len(todo) / grid.jobs) * grid.timeout_minutes * 60
    lines.append(f"  upper bound (every run hitting its {grid.timeout_minutes:g} min timeout): {_duration(bound)}")
    return (None if unknown else max(slots)), lines


def print_plan(grid: Grid, runs: list[Run], output_dir: str) -> None:
    """What --dry_run shows: the grid, every run and whether it is done, one full command, the time estimate."""
    runs_dir = os.path.join(output_dir, "runs")
    print(f"grid {os.path.relpath(grid.path, ROOT) if grid.path.startswith(ROOT) else grid.path}"
          + (f": {grid.description}" if grid.description else ""))
    print("  algorithms: " + ", ".join(f"{a.name} ({_rel(a.recipe)}" + (f", {a.flags}" if a.flags else "") + ")"
                                       for a in grid.algorithms))
    print(f"  {grid.knob} ({KNOBS[grid.knob]}): {grid.knob_values}   seeds: {grid.seeds}"
          + "".join(f"   {k}: {v}" for k, v in grid.axes.items()))
    print(f"  shared flags: {grid.flags}")
    print(f"  launcher: {grid.launcher}" + (f" --config_file {_rel(grid.accelerate_config)}" if grid.accelerate_config
                                            else "") + f"   jobs: {grid.jobs}   timeout: {grid.timeout_minutes:g} min")
    states = {r.name: run_finished(os.path.join(runs_dir, r.name), r.expects_eval) for r in runs}
    todo = [r for r in runs if not states[r.name]]
    print(f"runs in {runs_dir}/ ({len(runs)}: {len(runs) - len(todo)} finished, {len(todo)} to run"
          + ("; each writes eval_results.json" if any(r.expects_eval for r in runs) else "") + "):")
    width = max(len(r.name) for r in runs)
    for r in runs:
        print(f"  {r.name:<{width}}  {'finished (skip)' if states[r.name] else 'to run'}")
    if todo:
        first = todo[0]
        run_dir = os.path.join(runs_dir, first.name)
        print(f"command of {first.name} (its config.yaml holds its flags and output_dir):\n  "
              + " ".join(command(grid, first, run_dir)) + f"\n  flags: {first.flags}")
    seconds, lines = estimate(grid, runs, runs_dir)
    head = "unknown" if seconds is None else f"~{_duration(seconds)}"
    print(f"time estimate for the {len(todo)} run(s) to go, {grid.jobs} at a time: {head}")
    print("\n".join(lines), flush=True)


# ---- running -----------------------------------------------------------------------------------------------------
@dataclass
class Active:
    run: Run
    run_dir: str
    proc: subprocess.Popen
    log: object
    started: float
    deadline: float
    record: dict


def _stop(procs: list[subprocess.Popen], grace: float) -> None:
    """SIGTERM each process group (the recipe checkpoints and stops), then SIGKILL what is left after `grace`.
    A KeyboardInterrupt while waiting kills at once."""
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    try:
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.2)
    except KeyboardInterrupt:
        print("[sweep] second interrupt: killing now", flush=True)
    for p in procs:
        _signal_group(p, signal.SIGKILL)  # also reaps generator processes that outlived their parent
        p.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)  # the child leads its own session, so pgid == pid
    except (ProcessLookupError, PermissionError):
        pass


_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Failed|Timeout|Interrupt)\w*: ")


def error_line(log_path: str) -> str:
    """The last exception line of a log (not accelerate's wrapper error), else its last non-empty line."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [ln.strip() for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [ln for ln in lines if _ERROR_LINE.match(ln) and not ln.startswith("subprocess.CalledProcessError")]
    return (errors or lines or ["(empty log)"])[-1][:500]


def _start(grid: Grid, run: Run, runs_dir: str, timeout_s: float, env: dict) -> Active:
    run_dir = os.path.join(runs_dir, run.name)
    if os.path.isdir(run_dir):  # an unfinished attempt (checked by check_run_dirs): start clean, since the recipe
        shutil.rmtree(run_dir)  # appends to metrics.jsonl and a half-written one would mix two attempts
    os.makedirs(run_dir)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump({**run.flags, "output_dir": run_dir}, f, sort_keys=False)
    cmd = command(grid, run, run_dir)
    record = {"name": run.name, "algorithm": run.algorithm, "recipe": _rel(run.recipe), "knob": run.knob,
              "knob_value": run.knob_value, "seed": run.seed, "axes": run.axes, "flags": run.flags,
              "expects_eval": run.expects_eval, "index": run.index, "command": cmd, "grid": os.path.abspath(grid.path),
              "status": "running", "returncode": None, "seconds": None, "message": ""}
    _write_record(run_dir, record)
    log = open(os.path.join(run_dir, "log.txt"), "w")
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    except OSError:
        log.close()
        raise
    record["pgid"] = proc.pid  # its own session: pgid == pid
    _write_record(run_dir, record)
    now = time.monotonic()
    return Active(run, run_dir, proc, log, now, now + timeout_s, record)


def _finish(a: Active, status: str, message: str = "") -> dict:
    a.log.close()
    seconds = time.monotonic() - a.started
    rc = a.proc.returncode
    if status == "exited":
        if rc == 0 and run_finished(a.run_dir, a.run.expects_eval):
            status = "finished"
        else:
            status = "failed"
            message = error_line(os.path.join(a.run_dir, "log.txt")) if rc != 0 else (
                "exited 0 but did not write run_summary.json" + (" / eval_results.json" if a.run.expects_eval else ""))
    a.record.update(status=status, returncode=rc, seconds=round(seconds, 1), message=message)
    _write_record(a.run_dir, a.record)
    return a.record


def run_sweep(grid: Grid, runs: list[Run], output_dir: str, grace: float = 30.0, invocation: str = "") -> list[dict]:
    """Run every unfinished run, `grid.jobs` at a time. Returns one outcome per run (finished runs as 'skipped')."""
    jobs, timeout_s = grid.jobs, 60.0 * grid.timeout_minutes
    runs_dir = os.path.join(output_dir, "runs")
    os.makedirs(runs_dir, exist_ok=True)
    outcomes: dict[str, dict] = {}
    pending = []
    for run in runs:
        if run_finished(os.path.join(runs_dir, run.name), run.expects_eval):
            outcomes[run.name] = {"name": run.name, "status": "skipped", "message": "finished earlier"}
        else:
            pending.append(run)
    seconds, _ = estimate(grid, runs, runs_dir)
    print(f"[sweep] {len(runs)} runs: {len(runs) - len(pending)} already finished (skipped), {len(pending)} to run, "
          f"{jobs} at a time, timeout {timeout_s / 60:g} min each"
          + (f"; estimate ~{_duration(seconds)}" if seconds and pending else ""), flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.setdefault("WANDB_MODE", "offline")
    if jobs > 1 and "OMP_NUM_THREADS" not in env:  # concurrent runs share the cores instead of oversubscribing them
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // jobs))
    active: list[Active] = []
    done = 0
    try:
        while pending or active:
            while pending and len(active) < jobs:
                run = pending.pop(0)
                try:
                    a = _start(grid, run, runs_dir, timeout_s, env)
                except OSError as exc:  # e.g. the launcher cannot be executed: this run fails, the others go on
                    outcomes[run.name] = {"name": run.name, "status": "failed", "returncode": None, "seconds": 0.0,
                                          "message": f"could not start: {exc}"}
                    done += 1
                    print(f"[sweep] failed   {run.name}: could not start: {exc}", flush=True)
                    continue
                active.append(a)
                print(f"[sweep] start  {a.run.name}  (log: {os.path.join(a.run_dir, 'log.txt')})", flush=True)
            time.sleep(0.2)
            for a in list(active):
                if a.proc.poll() is not None:
                    outcome = _finish(a, "exited")
                elif time.monotonic() > a.deadline:
                    _stop([a.proc], grace)
                    outcome = _finish(a, "timeout", f"exceeded its timeout of {timeout_s / 60:g} min (timeout_minutes "
                                                    f"in {grid.path}, or --timeout_minutes) and was killed")
                else:
                    continue
                active.remove(a)
                outcomes[a.run.name] = outcome
                done += 1
                total = done + len(active) + len(pending)
                line = f"[sweep] [{done}/{total}] {outcome['status']:<8} {a.run.name}  {outcome['seconds']:.0f}s"
                if pending:  # the runs still queued, as estimated from the runs measured so far
                    left, _ = estimate(grid, pending, runs_dir)
                    line += f"  ({len(pending)} queued: ~{_duration(left)})" if left else ""
                if outcome["status"] != "finished":
                    line += f"\n         {outcome['message']}\n         log: {os.path.join(a.run_dir, 'log.txt')}"
                print(line, flush=True)
    except KeyboardInterrupt:
        print(f"[sweep] interrupted: stopping {len(active)} running run(s) (SIGTERM, SIGKILL after {grace:g}s; "
              "Ctrl-C again to kill now)", flush=True)
        _stop([a.proc for a in active], grace)
        for a in active:
            outcomes[a.run.name] = _finish(a, "interrupted", "stopped by Ctrl-C / SIGTERM of the sweep")
        for run in pending:
            outcomes[run.name] = {"name": run.name, "status": "not started", "message": "sweep interrupted"}
        _write_report(output_dir, grid, runs, outcomes, invocation)
        raise
    _write_report(output_dir, grid, runs, outcomes, invocation)
    return [outcomes[r.name] for r in runs]


def _write_report(output_dir: str, grid: Grid, runs: list[Run], outcomes: dict[str, dict], invocation: str) -> None:
    report = {"grid": os.path.abspath(grid.path), "description": grid.description, "command": invocation,
              "runs": [{k: outcomes[r.name].get(k) for k in ("name", "status", "returncode", "seconds", "message")}
                       for r in runs if r.name in outcomes]}
    report["failed"] = [o["name"] for o in report["runs"] if o["status"] not in ("finished", "skipped")]
    with open(os.path.join(output_dir, "sweep_report.json"), "w") as f:
        json.dump(report, f, indent=2)


def print_report(outcomes: list[dict], output_dir: str) -> None:
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o["status"]] = counts.get(o["status"], 0) + 1
    print("[sweep] done: " + ", ".join(f"{n} {s}" for s, n in counts.items()), flush=True)
    failed = [o for o in outcomes if o["status"] not in ("finished", "skipped")]
    if failed:
        print(f"[sweep] {len(failed)} run(s) did not finish (rerun the same command to retry them):", flush=True)
        for o in failed:
            print(f"  {o['name']}: {o['status']}: {o['message']}\n    log: "
                  f"{os.path.join(output_dir, 'runs', o['name'], 'log.txt')}", flush=True)


def _invocation(argv: list[str]) -> str:
    """The command line that made this sweep, for results.md ("Made by")."""
    import shlex

    script = os.path.relpath(os.path.abspath(__file__), ROOT)
    return " ".join(["python", script] + [shlex.quote(a) for a in argv])


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help=f"grid file (default: {os.path.relpath(DEFAULT_GRID, ROOT)})")
    parser.add_argument("--quick", action="store_true",
                        help=f"the minutes-scale grid {os.path.relpath(QUICK_GRID, ROOT)}")
    parser.add_argument("--output_dir", required=True, help="runs go to OUTPUT_DIR/runs/<name>/, the table and plots "
                                                            "to OUTPUT_DIR/results.{md,csv} and OUTPUT_DIR/plots/")
    parser.add_argument("--jobs", type=int, help="runs at a time (overrides the grid's `jobs`)")
    parser.add_argument("--timeout_minutes", type=float, help="per-run limit (overrides the grid's `timeout_minutes`)")
    parser.add_argument("--grace_seconds", type=float, default=30.0,
                        help="SIGTERM -> SIGKILL delay when stopping a run")
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="only runs whose name contains TEXT (repeatable: any of them)")
    parser.add_argument("--dry_run", action="store_true",
                        help="validate, print the plan and a time estimate, write nothing")
    parser.add_argument("--no_aggregate", action="store_true", help="skip the table and plots at the end")
    args = parser.parse_args(argv)
    if args.quick and args.config:
        parser.error("--quick is the grid launch/sweeps/quick.yaml; give --quick or --config, not both")
    if args.jobs is not None and args.jobs < 1:
        parser.error("--jobs must be >= 1")
    if args.timeout_minutes is not None and args.timeout_minutes <= 0:
        parser.error("--timeout_minutes must be > 0")
    grid_path = QUICK_GRID if args.quick else (args.config or DEFAULT_GRID)
    output_dir = os.path.abspath(args.output_dir)
    try:
        grid = load_grid(grid_path)
        runs = expand(grid)
        if args.only:
            runs = [r for r in runs if any(text in r.name for text in args.only)]
            if not runs:
                raise GridError(f"--only {args.only}: no run of {grid_path} matches")
        check_run_dirs(runs, os.path.join(output_dir, "runs"), grid_path)
    except GridError as exc:
        print(f"[sweep] error: {exc}", file=sys.stderr, flush=True)
        return 2
    grid.jobs = args.jobs or grid.jobs
    grid.timeout_minutes = args.timeout_minutes or grid.timeout_minutes
    if args.dry_run:
        print_plan(grid, runs, output_dir)
        return 0
    os.makedirs(output_dir, exist_ok=True)
    shutil.copyfile(grid_path, os.path.join(output_dir, "grid.yaml"))
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # `kill <sweep>` stops its runs like Ctrl-C does
    try:
        outcomes = run_sweep(grid, runs, output_dir, args.grace_seconds, invocation=_invocation(argv))
    except KeyboardInterrupt:
        print("[sweep] stopped; rerun the same command to continue where it left off", file=sys.stderr, flush=True)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print_report(outcomes, output_dir)
    if not args.no_aggregate:
        written = aggregate(output_dir)
        if written:
            print("[sweep] results: " + ", ".join(os.path.relpath(p, output_dir) for p in written), flush=True)
    return 0 if all(o["status"] in ("finished", "skipped") for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
