"""Command-line and YAML configuration for the recipes: `--config file.yaml` plus `--field value` flags.

YAML keys may name any field of the script's dataclasses; flags override the YAML. Unknown keys are an error
that names the file and suggests the closest field, before anything expensive starts.
"""

from __future__ import annotations

import os
from dataclasses import fields

import yaml
from transformers import HfArgumentParser

from async_rlhf.config import ConfigError


def parse_args(dataclass_types: tuple, argv: list[str], task_defaults: dict[str, str] | None = None):
    """Parse `argv` (`--config file.yaml` and `--field value` flags) into instances of `dataclass_types`.

    Precedence, lowest first: the dataclasses' defaults, the recipe's defaults for the chosen task
    (`task_defaults`: task name -> YAML file, e.g. tuned settings for the built-in task), the `--config` YAML,
    the flags."""
    parsed = _parse(dataclass_types, argv, None)
    task = getattr(parsed[0], "task", None)
    if task_defaults and task in task_defaults:
        parsed = _parse(dataclass_types, argv, task_defaults[task])
    return parsed


def _read_yaml(config_path: str, dataclass_types: tuple) -> dict:
    if not os.path.isfile(config_path):
        raise ConfigError(f"--config: {config_path} does not exist")
    with open(config_path) as f:
        try:
            values = yaml.safe_load(f) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{config_path}: not valid YAML: {exc}") from exc
    if not isinstance(values, dict):
        raise ConfigError(f"{config_path}: expected a mapping of field: value, got {type(values).__name__}")
    known = {f.name for cls in dataclass_types for f in fields(cls)}
    unknown = {k: v for k, v in values.items() if k not in known}
    if unknown:
        import difflib

        hints = [f"{k!r}" + (f" (did you mean {', '.join(difflib.get_close_matches(k, known, 3))}?)"
                             if difflib.get_close_matches(k, known, 3) else "") for k in unknown]
        raise ConfigError(f"{config_path}: unknown field(s) {', '.join(hints)}")
    return values


def _parse(dataclass_types: tuple, argv: list[str], defaults_path: str | None):
    config_path = None
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config: needs a YAML file path")
        config_path = argv[i + 1]
        argv = argv[:i] + argv[i + 2:]
    parser = HfArgumentParser(dataclass_types)
    if defaults_path is not None:
        parser.set_defaults(**_read_yaml(defaults_path, dataclass_types))
    if config_path is not None:
        parser.set_defaults(**_read_yaml(config_path, dataclass_types))
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ConfigError:
        raise
    except ValueError as exc:  # __post_init__ validation errors come through here with the field named
        raise ConfigError(str(exc)) from exc
