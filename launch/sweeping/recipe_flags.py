"""The recipes a sweep can run, and the flags each accepts: a static table of the dataclasses each recipe parses.

Guarantees:
- `SWEEP_RECIPES` names every recipe under recipes/ whose config class is an `AsyncRLConfig` (the ones with the
  off-policy knobs); tests/unit/test_sweep_grid.py checks it against recipes/, so a new recipe that is not added
  here fails a test instead of a sweep;
- `recipe_options` answers without importing a recipe or vLLM: the classes come from async_rlhf.config.base and
  async_rlhf.tasks.setup, which import transformers (and torch) but nothing else heavy;
- a script outside recipes/ (a grid may name any path) has no entry: its flag names are not checked here, and the
  script itself rejects unknown flags when its run starts.
The table replaces importing every recipe in a subprocess to scrape its module globals, which tied the sweep to
the recipes' import lines.
"""

from __future__ import annotations

import dataclasses
import os

from async_rlhf.config.algorithms import (AsyncBestOfNConfig, AsyncGRPOConfig, AsyncOnlineDPOConfig, AsyncPPOConfig,
                                          AsyncRLOOConfig)
from async_rlhf.tasks.setup import ScriptArguments

from launch.sweeping import ROOT

RECIPES_DIR = os.path.join(ROOT, "recipes")
# recipe name (recipes/<name>.py) -> (its config class, its script-arguments class): what `run_recipe` parses
SWEEP_RECIPES = {
    "online_dpo": (AsyncOnlineDPOConfig, ScriptArguments),
    "rloo": (AsyncRLOOConfig, ScriptArguments),
    "ppo": (AsyncPPOConfig, ScriptArguments),
    "best_of_n": (AsyncBestOfNConfig, ScriptArguments),
    "grpo": (AsyncGRPOConfig, ScriptArguments),
}


def recipe_name(recipe_path: str) -> str | None:
    """`online_dpo` for <checkout>/recipes/online_dpo.py; None for a script elsewhere."""
    directory, file = os.path.split(os.path.abspath(recipe_path))
    return file[:-3] if directory == RECIPES_DIR and file.endswith(".py") else None


def _defaults(*classes) -> dict:
    """{flag: default} over the classes, later classes winning a shared name (as the recipe's parser resolves it).
    Defaults that are not plain values (factories, objects) are None: only their names matter here."""
    options = {}
    for cls in classes:
        for f in dataclasses.fields(cls):
            d = f.default
            options[f.name] = d if isinstance(d, (str, int, float, bool, type(None))) else None
    return options


def recipe_options(recipe_path: str) -> dict | None:
    """{flag: default} of a recipe under recipes/ that the sweep runs; None for a script outside recipes/. A recipe
    under recipes/ missing from the table is a KeyError the caller reports (it is not one the sweep can run)."""
    name = recipe_name(recipe_path)
    if name is None:
        return None
    return _defaults(*SWEEP_RECIPES[name])


def task_defaults() -> dict:
    """{flag: default} of the task flags every RL recipe takes (async_rlhf.tasks.setup.ScriptArguments): what the sweep
    assumes about a script outside recipes/ to know whether its runs write eval_results.json."""
    return _defaults(ScriptArguments)
