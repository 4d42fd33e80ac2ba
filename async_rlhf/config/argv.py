"""vLLM-style command-line flags in an argument list: a flag's name (`--a_b` and `--a-b` alike), its value
(`--flag value` or `--flag=value`), and the list without it. Used where our commands pass the rest on to vLLM's
(`generation/serve.py`, `config/speculative.server_argv`)."""

from __future__ import annotations


def flag_name(arg: str) -> str:
    return arg.split("=", 1)[0].replace("_", "-")


def flag_value(argv: list[str], flag: str, default: str) -> str:
    for i, arg in enumerate(argv):
        if flag_name(arg) == flag:
            return arg.split("=", 1)[1] if "=" in arg else argv[i + 1]
    return default


def without_flag(argv: list[str], flag: str) -> list[str]:
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif flag_name(arg) == flag:
            skip = "=" not in arg
        else:
            out.append(arg)
    return out
