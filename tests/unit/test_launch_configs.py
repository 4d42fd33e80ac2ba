"""Every config file under launch/ parses and names only options that exist."""

from __future__ import annotations

import glob
import os
from dataclasses import fields

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "launch/configs/*.yaml")))
ACCELERATE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "launch/accelerate/*.yaml")))


def _recipe_fields() -> set[str]:
    import importlib.util

    from async_rlhf.config import AsyncOnlineDPOConfig

    spec = importlib.util.spec_from_file_location("online_dpo_recipe", os.path.join(ROOT, "recipes/online_dpo.py"))
    recipe = importlib.util.module_from_spec(spec)
    import sys

    sys.modules[spec.name] = recipe  # dataclasses resolve string annotations through sys.modules
    spec.loader.exec_module(recipe)
    return {f.name for cls in (recipe.ScriptArguments, AsyncOnlineDPOConfig) for f in fields(cls)}


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=os.path.basename)
def test_recipe_config_fields_exist_and_validate(path, tmp_path):
    from async_rlhf.cli import parse_args
    from async_rlhf.config import AsyncOnlineDPOConfig

    values = yaml.safe_load(open(path))
    assert isinstance(values, dict)
    unknown = set(values) - _recipe_fields()
    assert not unknown, f"{path}: unknown fields {unknown}"
    keys = {f.name for f in fields(AsyncOnlineDPOConfig)}
    trimmed = tmp_path / "c.yaml"
    trimmed.write_text(yaml.safe_dump({k: v for k, v in values.items() if k in keys}))
    parse_args((AsyncOnlineDPOConfig,), ["--config", str(trimmed)])  # runs __post_init__ validation


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=os.path.basename)
def test_accelerate_config_names_only_real_options(path):
    from accelerate.commands.config.config_args import ClusterConfig

    values = yaml.safe_load(open(path))
    known = {f.name for f in fields(ClusterConfig)}
    assert not set(values) - known, f"{path}: unknown accelerate options {set(values) - known}"
    ClusterConfig.from_yaml_file(path)


def test_there_are_configs():
    assert RECIPE_CONFIGS and ACCELERATE_CONFIGS
