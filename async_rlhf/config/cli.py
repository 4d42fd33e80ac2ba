"""Command-line and YAML configuration for the recipes: `--config file.yaml` plus `--field value` flags.

YAML keys may name any field of the script's dataclasses; flags override the YAML. Unknown keys are an error
that names the file and suggests the closest field, before anything expensive starts. A list field takes its
values space-separated (`--generator_devices cuda:6 cuda:7`, HfArgumentParser's form), comma-separated
(`--generator_devices cuda:6,cuda:7`) or both; in YAML, a list or one comma-separated string.
"""

from __future__ import annotations

import os
import sys
from dataclasses import fields

import yaml
from transformers import HfArgumentParser

from async_rlhf.errors import ConfigError

RECIPE_DEFAULTS = {"generator_early_start": True}


def parse_args(dataclass_types: tuple, argv: list[str], task_defaults: dict[str, str] | None = None):
    """Parse `argv` (`--config file.yaml` and `--field value` flags) into instances of `dataclass_types`.

    Precedence, lowest first: the dataclasses' defaults, `RECIPE_DEFAULTS` (what a recipe run does differently from
    a trainer built in a script: it trains at once, so its generators start while the models load), the recipe's
    defaults for the chosen task
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
    known = {f.name for cls in dataclass_types for f in fields(cls)}
    parser.set_defaults(**{k: v for k, v in RECIPE_DEFAULTS.items() if k in known})
    list_actions = {a.dest: a for a in parser._actions if a.nargs in ("+", "*")}
    for path in (defaults_path, config_path):
        if path is not None:
            values = _read_yaml(path, dataclass_types)
            for name, value in values.items():
                if name in list_actions and isinstance(value, str):
                    values[name] = [_convert(list_actions[name], v) for v in value.split(",") if v.strip()]
            parser.set_defaults(**values)
    argv = split_list_values(argv, {flag for a in list_actions.values() for flag in a.option_strings})
    try:
        return parser.parse_args_into_dataclasses(args=argv)
    except ConfigError:
        raise
    except ValueError as exc:  # __post_init__ validation errors come through here with the field named
        raise ConfigError(str(exc)) from exc


def split_list_values(argv: list[str], list_flags: set[str]) -> list[str]:
    """Split the comma-separated values of list flags into separate arguments: `--generator_devices cuda:6,cuda:7`
    (or `=cuda:6,cuda:7`) becomes `--generator_devices cuda:6 cuda:7`, the form argparse's nargs="+" reads. Only
    the values that follow a list flag (up to the next `--flag`) are split."""
    out: list[str] = []
    in_list = False
    for token in argv:
        if token.startswith("--"):
            flag, eq, value = token.partition("=")
            in_list = flag in list_flags
            if in_list and eq:
                out.append(flag)
                out += [v for v in value.split(",") if v]
            else:
                out.append(token)
        elif in_list and "," in token:
            out += [v for v in token.split(",") if v]
        else:
            out.append(token)
    return out


def _convert(action, value: str):
    value = value.strip()
    try:
        return action.type(value) if action.type is not None else value
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{action.dest}: {value!r} is not a valid {getattr(action.type, '__name__', 'value')}") \
            from exc


def set_process_defaults() -> None:
    """Environment defaults for a recipe's process, set before the libraries read them (children inherit them):
    - wandb offline unless the user set WANDB_MODE (no login prompt when `report_to` names wandb);
    - DeepSpeed told it runs on the CPU when no GPU is visible: left to detect it, it warns "Setting accelerator to
      CPU. If you have GPU or other accelerator, we were unable to detect it." on every run, though nothing is wrong;
    - transformers' own progress bars ("Loading weights", "Writing model shards") shown only once they have run
      `BAR_DELAY_SECONDS` (`delayed_bars`): a run loads and saves its models several times (policy, reference, the
      evaluations, the final save), and a bar for a load that took no time is a line that says nothing; a large
      model's load still shows its bar. Downloads from the hub are huggingface_hub's bars, untouched; a tqdm hook
      the user set is kept.
    """
    os.environ.setdefault("WANDB_MODE", "offline")
    import torch
    from transformers.utils import logging as hf_logging

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    previous = hf_logging.set_tqdm_hook(delayed_bars)
    if previous not in (None, delayed_bars):  # the user's own hook decides
        hf_logging.set_tqdm_hook(previous)


BAR_DELAY_SECONDS = 2.0


def delayed_bars(factory, args: tuple, kwargs: dict):
    """transformers' tqdm hook: a bar appears only after `BAR_DELAY_SECONDS` (tqdm's `delay`) unless its caller
    set a delay of its own."""
    return factory(*args, **{"delay": BAR_DELAY_SECONDS, **kwargs})


def run_recipe(main, argv: list[str]) -> None:
    """A recipe's entry point: `set_process_defaults()`, then `main(argv)`. A run stopped by a signal (Ctrl-C,
    SIGTERM: the trainer finishes its step and saves a checkpoint first) ends with its one line and exit status 130,
    as a shell reports an interrupted command, not with a traceback."""
    set_process_defaults()
    try:
        main(argv)
    except KeyboardInterrupt as exc:
        print(f"async_rlhf: {exc or 'interrupted'}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
