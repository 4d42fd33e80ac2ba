"""Every command line shown in README.md, docs/*.md and the recipes' docstrings parses through the real parser of
what it runs.

The commands are extracted from the files (so a new doc command is covered without editing this test): each line of
a ```bash block (backslash continuations joined, comments dropped), each inline `code span` that is a command (see
`_is_command`), and each line of a recipe's docstring that starts with `python` or `accelerate`. A line is split
into shell segments
(`&&`, `;`, `&`, `|`), and each segment is checked by what it runs:
- `accelerate launch ...`: accelerate's own `launch` parser (its flags exist, `--config_file` exists); then the
  script it launches, with its arguments, as below (and, in a test of its own, that accelerate prints no notice
  about defaults it chose, for a new user whose accelerate default config is the one `scripts/install.sh` gives);
- `recipes/<name>.py ...`: the recipe's `main` up to the end of its parse step (`cli.parse_args` with the recipe's
  dataclasses and task defaults, including every `__post_init__` check), stopped there;
- other Python scripts of this repository and `python -m async_rlhf...` modules (launch/sweep.py, evals/*.py, the
  generator server): their `main` up to the end of `argparse`'s `parse_args`, stopped there.
Anything else (`bash scripts/install.sh`, `pip`, `pytest`, `export`) is not checked; a bare script path in prose
(`recipes/rloo.py`) is a reference, not a command.

Placeholders are substituted before parsing:
- `HUB` -> the flags README.md says it stands for ("`HUB` below stands for `...`"), read from README.md itself;
- `<anything>` -> `PLACEHOLDER` (a dummy word: `<policy>`, `<node 0 address>`, `<secret>`);
- a shell variable `$g` / `${g}` -> `0` (the first value of the README's `for g in 0 1` loop); `$(...)` -> `PLACEHOLDER`;
- `...` (more flags as above) is dropped, and optional flags in `[--flag value]` brackets are kept, unbracketed.
GPU-only flags (`--bf16 true`) are parsed as on a machine with a bf16-capable GPU, and `--generator_launcher ray` as
on one with Ray installed.
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib
import importlib.util
import logging
import os
import pathlib
import re
import shlex
import sys

import pytest

ROOT = next(str(p) for p in pathlib.Path(__file__).resolve().parents if (p / "pyproject.toml").exists())
DOC_FILES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
COMMAND_WORDS = ("accelerate", "python", "python3")


class _Parsed(Exception):
    """Raised right after a parse step succeeds: the command's flags are valid; nothing else runs."""


def _hub_flags() -> str:
    text = open(os.path.join(ROOT, "README.md")).read()
    match = re.search(r"`HUB` below stands for `([^`]+)`", text, re.S)
    return " ".join(match.group(1).split()) if match else ""


def _substitute(command: str) -> str:
    if re.search(r"\bHUB\b", command):
        flags = _hub_flags()
        assert flags, "README.md uses HUB but no longer says what it stands for (`HUB` below stands for `...`)"
        command = re.sub(r"\bHUB\b", flags, command)
    command = re.sub(r"\[(--[^\]]*)\]", r"\1", command)  # optional flags: check them too
    command = re.sub(r"<[^<>]+>", "PLACEHOLDER", command)
    command = re.sub(r"\$\([^)]*\)", "PLACEHOLDER", command)
    command = re.sub(r"\$\{?\w+\}?", "0", command)
    return command


def _is_command(text: str) -> bool:
    """An inline span is a command when one of its shell segments runs something with arguments; a bare script
    path (`recipes/rloo.py`), a bare word (`accelerate launch`) or a pattern (`python recipes/<recipe>.py`) is a
    reference, not a command."""
    if re.search(r"<[^<>]+>\.py\b", text):
        return False
    for tokens in _segments(text):
        if len(tokens) < 2:
            continue
        if tokens[0] in COMMAND_WORDS and any(t.endswith(".py") for t in tokens):
            return True
        if tokens[0] in COMMAND_WORDS and "-m" in tokens and len(tokens) > tokens.index("-m") + 2:
            return True  # `python -m module args` (a bare `python -m module` names the module)
        if tokens[0].endswith(".py") and os.path.isfile(os.path.join(ROOT, tokens[0])):
            return True
    return False


def doc_commands() -> list[tuple[str, str]]:
    """(where, command) for every command line in the docs."""
    found = []
    for path in DOC_FILES:
        text = open(path).read()
        name = os.path.relpath(path, ROOT)
        for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    found.append((name, line))
        prose = re.sub(r"```.*?```", "", text, flags=re.S)
        found += [(name, span.strip()) for span in re.findall(r"`([^`\n]+)`", prose) if _is_command(span.strip())]
    for path in sorted(glob.glob(os.path.join(ROOT, "recipes", "*.py"))):
        docstring = ast.get_docstring(ast.parse(open(path).read()), clean=False) or ""
        for line in docstring.replace("\\\n", " ").splitlines():
            if line.strip().startswith(COMMAND_WORDS):
                found.append((os.path.relpath(path, ROOT), line.strip()))
    return found


def _segments(command: str) -> list[list[str]]:
    lexer = shlex.shlex(_substitute(command), posix=True, punctuation_chars=";&|")
    lexer.whitespace_split, lexer.commenters = True, "#"
    segments, current = [], []
    for token in lexer:
        if token in (";", "&", "&&", "|", "||"):
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    out = []
    for tokens in segments:
        tokens = [t for t in tokens if t != "..."]
        while tokens and (tokens[0] in ("do", "then", "done") or re.fullmatch(r"[A-Za-z_]\w*=\S*", tokens[0])):
            tokens = tokens[1:]  # shell keywords and VAR=value prefixes
        if tokens:
            out.append(tokens)
    return out


def _load_file(path: str):
    name = "doc_command_" + re.sub(r"\W", "_", os.path.relpath(path, ROOT))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _run_parse_step(module, args: list[str], monkeypatch, recipe: bool) -> None:
    """Run `module.main(args)` until its parse step has succeeded."""
    if recipe:
        real = module.parse_args

        def parse_then_stop(*a, **k):
            raise _Parsed(real(*a, **k))

        monkeypatch.setattr(module, "parse_args", parse_then_stop)
    else:
        real = argparse.ArgumentParser.parse_args

        def parse_then_stop(self, *a, **k):
            raise _Parsed(real(self, *a, **k))

        monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    with pytest.raises(_Parsed):
        module.main(args)


def _parse_accelerate(tokens: list[str]) -> argparse.Namespace:
    """`accelerate launch ...` through accelerate's own parser; its `--config_file` must exist."""
    from accelerate.commands import launch

    assert tokens[1] == "launch", tokens
    args = launch.launch_command_parser().parse_args(tokens[2:])
    if args.config_file:
        assert os.path.isfile(os.path.join(ROOT, args.config_file)), f"{args.config_file} does not exist"
    return args


def _defaults_notices(args: argparse.Namespace) -> list[str]:
    """What `accelerate launch` says about defaults it chose for `args`, validated as it does."""
    from accelerate.commands import launch

    notices = []

    class Collect(logging.Handler):
        def emit(self, record):
            notices.append(record.getMessage())

    handler = Collect(level=logging.WARNING)
    logging.getLogger().addHandler(handler)
    try:
        launch._validate_launch_command(args)
    finally:
        logging.getLogger().removeHandler(handler)
    return [n for n in notices if "had defaults used instead" in n]


def check_command(tokens: list[str], monkeypatch) -> str | None:
    """Check one shell segment; returns what was checked (None: not ours to check)."""
    if tokens[0] == "accelerate":
        args = _parse_accelerate(tokens)
        tokens = [args.training_script] + args.training_script_args
    elif tokens[0] in ("python", "python3"):
        tokens = tokens[1:]
    if tokens[:1] == ["-m"]:
        if not tokens[1].startswith("async_rlhf"):
            return None  # pytest, pip, ...
        _run_parse_step(importlib.import_module(tokens[1]), tokens[2:], monkeypatch, recipe=False)
        return tokens[1]
    script = tokens[0]
    if not script.endswith(".py"):
        return None
    path = os.path.join(ROOT, script)
    assert os.path.isfile(path), f"{script} does not exist"
    monkeypatch.syspath_prepend(os.path.dirname(path))  # as `python script.py` puts the script's folder first
    module = _load_file(path)
    _run_parse_step(module, tokens[1:], monkeypatch, recipe=script.startswith("recipes/"))
    return script


COMMANDS = doc_commands()


def test_the_docs_have_commands():
    assert len(COMMANDS) >= 30, COMMANDS  # the extraction still finds them
    assert any("HUB" in c for _, c in COMMANDS)


IDS = [f"{w}:{c[:60]}" for w, c in COMMANDS]


@pytest.mark.parametrize("where, command", COMMANDS, ids=IDS)
def test_doc_command_parses(where, command, monkeypatch):
    monkeypatch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)
    # Ray is an optional extra the Ray rows name (requirements-ray.txt): their flags are checked as where it is installed
    monkeypatch.setattr("async_rlhf.config.checks.ray_installed", lambda: True)
    monkeypatch.chdir(ROOT)  # the docs' paths are relative to the repository root
    for tokens in _segments(command):
        try:
            check_command(tokens, monkeypatch)
        except (AssertionError, SystemExit, Exception) as exc:
            if isinstance(exc, pytest.fail.Exception):
                raise
            pytest.fail(f"{where}: `{command}`\n  segment {' '.join(tokens)}\n  {type(exc).__name__}: {exc}")


ACCELERATE_COMMANDS = [(w, c, tokens) for w, c in COMMANDS for tokens in _segments(c) if tokens[0] == "accelerate"]


@pytest.mark.parametrize("where, command, tokens", ACCELERATE_COMMANDS, ids=[f"{w}:{c[:60]}" for w, c, _ in
                                                                            ACCELERATE_COMMANDS])
def test_doc_accelerate_commands_print_no_defaults_notice(where, command, tokens, monkeypatch):
    """`accelerate launch` without a config file prints four lines about the defaults it used; the documented
    commands give it what it needs (a new user's machine after `bash scripts/install.sh`: accelerate's default
    config is ours, `launch/accelerate/default_config.yaml`, which `install_default_config.py` puts there)."""
    from accelerate.commands import launch
    from accelerate.commands.config import config_args

    installed = os.path.join(ROOT, "launch/accelerate/default_config.yaml")
    monkeypatch.setattr(launch, "default_config_file", installed)  # where launch looks, and where it then reads
    monkeypatch.setattr(config_args, "default_config_file", installed)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # as in a fresh shell (conftest sets it for the tests)
    monkeypatch.chdir(ROOT)
    notices = _defaults_notices(_parse_accelerate(tokens))
    assert not notices, f"{where}: `{command}` makes accelerate print:\n{notices[0]}"


@pytest.mark.parametrize("argv", [["--generator_devices", "cuda:6,cuda:7"], ["--generator_devices", "cuda:6", "cuda:7"],
                                  ["--generator_devices=cuda:6,cuda:7"], ["--generator_devices", "cuda:6,cuda:7",
                                                                          "--beta", "0.2"]])
def test_list_fields_take_comma_and_space_separated_values(argv):
    from async_rlhf.config.algorithms import AsyncOnlineDPOConfig
    from async_rlhf.config.cli import parse_args
    from async_rlhf.tasks.setup import ScriptArguments

    _, config = parse_args((ScriptArguments, AsyncOnlineDPOConfig), ["--task", "toy"] + argv)
    assert config.generator_devices == ["cuda:6", "cuda:7"]


def test_list_of_numbers_and_yaml_strings_split_too(tmp_path):
    from async_rlhf.config.algorithms import AsyncOnlineDPOConfig
    from async_rlhf.config.cli import parse_args
    from async_rlhf.tasks.setup import ScriptArguments

    _, config = parse_args((ScriptArguments, AsyncOnlineDPOConfig),
                           ["--task", "toy", "--beta", "0.1,0.2", "--reward_weights", "1,-0.5"])
    assert config.beta == [0.1, 0.2] and config.reward_weights == [1.0, -0.5]
    path = tmp_path / "c.yaml"
    path.write_text("generator_servers: 'a:1,b:2'\nreward_weights: '2, 3'\n")
    _, config = parse_args((ScriptArguments, AsyncOnlineDPOConfig), ["--config", str(path)])
    assert config.generator_servers == ["a:1", "b:2"] and config.reward_weights == [2.0, 3.0]


def test_no_script_shadows_the_standard_library():
    # `python benchmarks/x.py` puts benchmarks/ first on the import path: a benchmarks/profile.py stood in for the
    # standard library's `profile`, which cProfile (imported by torch._dynamo) needs
    for folder in ("benchmarks", "recipes", "examples", "scripts"):
        names = {f[:-3] for f in os.listdir(os.path.join(ROOT, folder)) if f.endswith(".py")}
        assert not names & set(sys.stdlib_module_names), f"{folder}/ shadows {sorted(names & set(sys.stdlib_module_names))}"


def test_the_builtin_policy_path_in_the_docs_is_the_cache_path():
    """README's one-machine server command names the built-in task's policy directory: it must be the one the task
    builds (its cache version changes when the task does)."""
    from async_rlhf.tasks.cache import default_cache_dir

    text = open(os.path.join(ROOT, "README.md")).read()
    named = set(re.findall(r"~/\.cache/async_rlhf/(builtin-v\d+)/sft_model", text))
    assert named, "README.md no longer names the built-in policy's directory"
    assert named == {os.path.basename(default_cache_dir())}, named
