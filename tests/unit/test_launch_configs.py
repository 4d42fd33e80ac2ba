"""Every config file under launch/ parses and names only options that exist: recipe configs (our dataclasses),
accelerate configs (accelerate's `ClusterConfig` and `accelerate launch`'s DeepSpeed options) and DeepSpeed JSON
files (DeepSpeed's own config classes)."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import fields

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "launch/configs/*.yaml")))
ACCELERATE_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "launch/accelerate/*.yaml")))
DEEPSPEED_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "launch/deepspeed/*.json")))
SWEEP_CONFIGS = sorted(glob.glob(os.path.join(ROOT, "launch/sweeps/*.yaml")))
ALL_CONFIG_FILES = sorted(p for ext in ("yaml", "yml", "json") for p in glob.glob(os.path.join(ROOT, f"launch/**/*.{ext}"),
                                                                                     recursive=True))


def _recipe_classes(path: str):
    """(ScriptArguments, config class) of the recipe a config file is for: `<recipe>_<name>.yaml`, else online DPO.
    The sweep's table of recipes is the one place that pairs a recipe with its classes."""
    from launch.sweeping.recipe_flags import SWEEP_RECIPES

    name = os.path.basename(path)
    recipe = next((r for r in SWEEP_RECIPES if name.startswith(r + "_")), "online_dpo")
    config_class, script_class = SWEEP_RECIPES[recipe]
    return script_class, config_class


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=os.path.basename)
def test_recipe_config_fields_exist_and_validate(path, tmp_path):
    from async_rlhf.config.cli import parse_args

    script_class, config_class = _recipe_classes(path)
    values = yaml.safe_load(open(path))
    assert isinstance(values, dict)
    known = {f.name for cls in (script_class, config_class) for f in fields(cls)}
    unknown = set(values) - known
    assert not unknown, f"{path}: unknown fields {unknown}"
    parse_args((script_class, config_class), ["--config", path])  # runs __post_init__ validation


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=os.path.basename)
def test_accelerate_config_names_only_real_options(path):
    from accelerate.commands.config.config_args import ClusterConfig

    values = yaml.safe_load(open(path))
    known = {f.name for f in fields(ClusterConfig)}
    assert not set(values) - known, f"{path}: unknown accelerate options {set(values) - known}"
    config = ClusterConfig.from_yaml_file(path)
    if config.deepspeed_config:
        from accelerate.commands.launch import launch_command_parser

        group = next(g for g in launch_command_parser()._action_groups if g.title == "DeepSpeed Arguments")
        ds_options = {action.dest for action in group._group_actions}
        unknown = set(config.deepspeed_config) - ds_options
        assert not unknown, f"{path}: unknown deepspeed_config options {unknown} (accelerate knows {ds_options})"
        ds_file = config.deepspeed_config.get("deepspeed_config_file")
        if ds_file is not None:  # relative to the repository root, where the commands in README run
            assert os.path.isfile(os.path.join(ROOT, ds_file)), f"{path}: {ds_file} does not exist"
            assert ds_file.startswith("launch/deepspeed/"), f"{path}: keep DeepSpeed JSON files in launch/deepspeed/"


# The values the transformers Trainer puts in place of "auto" (from TrainingArguments and the model's hidden size)
# before DeepSpeed reads the config; an "auto" anywhere else would reach DeepSpeed unresolved.
TRAINER_FILLED_AUTO = {
    "train_micro_batch_size_per_gpu": 1, "train_batch_size": 2, "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0, "enabled": False, "lr": 1e-5, "betas": [0.9, 0.999], "eps": 1e-8,
    "weight_decay": 0.0, "reduce_bucket_size": 4096, "stage3_prefetch_bucket_size": 3686,
    "stage3_param_persistence_threshold": 640,
}


def _fill_auto(node, where=""):
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if value == "auto":
                assert key in TRAINER_FILLED_AUTO, f"{where}{key}: 'auto' that the Trainer does not fill"
                value = TRAINER_FILLED_AUTO[key]
            out[key] = _fill_auto(value, f"{where}{key}.")
        return out
    return node


def _deepspeed_top_level_keys() -> set[str]:
    import deepspeed.runtime.constants as constants
    from deepspeed.runtime.zero.config import ZERO_OPTIMIZATION

    return {v for k, v in vars(constants).items() if k.isupper() and isinstance(v, str)} | {ZERO_OPTIMIZATION}


@pytest.mark.parametrize("path", DEEPSPEED_CONFIGS, ids=os.path.basename)
def test_deepspeed_config_names_only_real_options(path):
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    values = json.load(open(path))
    unknown = set(values) - _deepspeed_top_level_keys()
    assert not unknown, f"{path}: unknown DeepSpeed keys {unknown}"
    resolved = _fill_auto(values)
    DeepSpeedZeroConfig(**resolved.get("zero_optimization", {}))  # pydantic, extra="forbid": rejects unknown keys
    config = DeepSpeedConfig(resolved)  # the whole file, as deepspeed.initialize reads it
    assert config.zero_optimization_stage == values.get("zero_optimization", {}).get("stage", 0)


def test_deepspeed_key_check_catches_misspellings():
    from pydantic import ValidationError
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    assert "zero_optimisation" not in _deepspeed_top_level_keys()
    with pytest.raises(ValidationError):
        DeepSpeedZeroConfig(stage=3, stage3_gather_16bit_weights_on_model_saves=True)


@pytest.mark.parametrize("path", SWEEP_CONFIGS, ids=os.path.basename)
def test_sweep_grid_validates(path):
    from launch.sweeping.grid import load_grid

    load_grid(path)  # the sweep runner's own validation: keys, recipes, flag names


@pytest.mark.parametrize("path", ALL_CONFIG_FILES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_config_file_under_launch_is_checked(path):
    checked = set(RECIPE_CONFIGS) | set(ACCELERATE_CONFIGS) | set(DEEPSPEED_CONFIGS) | set(SWEEP_CONFIGS)
    assert path in checked, f"{path} is not covered by a test in this file: add it to one of the lists above"


def test_there_are_configs():
    assert RECIPE_CONFIGS and ACCELERATE_CONFIGS and DEEPSPEED_CONFIGS
