"""The `speculative` option of vLLM generators: names, checks, and the `speculative_config` vLLM is built with.

Methods (all through vLLM 0.32's own speculative decoding; each draft is verified by the policy with rejection
sampling, so the samples keep exactly the policy's distribution and their behaviour log-probs are the policy's,
token by token; on vLLM's CPU build that needs `spec_decode_cpu.py`):
* "off": no speculation;
* "ngram": vLLM's prompt lookup (drafts the tokens that followed the last n-gram earlier in the same sequence);
* "suffix": vLLM's suffix decoding (suffix trees over the prompt and earlier responses), which needs the
  `arctic-inference` package;
* "history": our proposer (`experimental/speculative/history_proposer.py`) behind vLLM's `custom_class` interface: drafts from earlier
  sequences of the same engine, so from earlier completions of the same prompt in this run;
* "auto": measured once per policy and machine (`experimental/speculative/choice.py`), then one of the above.

Nothing here imports vLLM: the config checks run before any engine starts.
"""

from __future__ import annotations

import importlib.util
import json

from async_rlhf.config.argv import flag_name, flag_value, without_flag

METHODS = ("off", "ngram", "suffix", "history", "auto")
MAX_TOKENS = 16  # vLLM accepts up to 128; beyond a few tokens the acceptance of cheap drafts is near zero
HISTORY_CLASS = "async_rlhf.experimental.speculative.history_proposer.HistoryProposer"
NGRAM_MIN, NGRAM_MAX = 2, 4  # prompt-lookup n-gram lengths for "ngram"


class SpeculativeError(ValueError):
    """A `speculative` setting that cannot run; the message names the option and what to change."""


def suffix_available() -> bool:
    return importlib.util.find_spec("arctic_inference") is not None


def check(method: str, num_tokens: int, backend: str, servers: bool, min_p: float = 0.0) -> None:
    """Refuse a `speculative` setting that cannot run, before any engine starts. `backend`: the generator backend
    as far as it is known ('auto' passes: it is checked again once decided)."""
    if method not in METHODS:
        raise SpeculativeError(f"speculative: {method!r} is not one of {METHODS}")
    if method == "off":
        return
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or not 1 <= num_tokens <= MAX_TOKENS:
        raise SpeculativeError(f"num_speculative_tokens: must be an integer in [1, {MAX_TOKENS}] with "
                               f"speculative={method!r}, got {num_tokens!r}")
    if backend == "transformers":
        raise SpeculativeError(f"speculative: {method!r} needs vLLM generators, but generator_backend='transformers' "
                               "samples one token per step; set generator_backend='vllm' or speculative='off'")
    if servers:
        raise SpeculativeError(f"speculative: {method!r} applies to local generators; generator_servers run the "
                               "speculation they were started with: start each with `python -m "
                               f"async_rlhf.generation.serve --speculative {method if method != 'auto' else 'ngram'} "
                               "...` and leave speculative='off' here")
    if method == "suffix" and not suffix_available():
        raise SpeculativeError("speculative: 'suffix' needs the arctic-inference package, which is not installed; "
                               "`pip install arctic-inference`, or use speculative='ngram' or 'history'")
    if min_p:
        raise SpeculativeError(f"speculative: {method!r} cannot be combined with min_p={min_p} (vLLM's rejection "
                               "sampler ignores min_p); set min_p=0 or speculative='off'")


def vllm_config(method: str, num_tokens: int) -> dict | None:
    """The `speculative_config` for `vllm.LLM` (None: off). `method` must be decided (not 'auto')."""
    if method == "off":
        return None
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_tokens,
                "prompt_lookup_min": NGRAM_MIN, "prompt_lookup_max": NGRAM_MAX}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": num_tokens}
    if method == "history":
        return {"method": "custom_class", "model": HISTORY_CLASS, "num_speculative_tokens": num_tokens}
    raise ValueError(f"speculative method {method!r} has no vLLM config (decide 'auto' first)")


def server_argv(argv: list[str]) -> list[str]:
    """`python -m async_rlhf.generation.serve`'s arguments with our `--speculative METHOD [--speculative_tokens K]`
    replaced by vLLM's `--speculative-config JSON`. Raises SystemExit naming the option for a setting that cannot
    run."""
    method = flag_value(argv, "--speculative", "off")
    tokens = flag_value(argv, "--speculative-tokens", "4")
    argv = without_flag(without_flag(argv, "--speculative"), "--speculative-tokens")
    if method == "off":
        return argv
    if method == "auto":
        raise SystemExit("--speculative auto: only local generators measure; pick ngram, suffix or history")
    try:
        count = int(tokens)
    except ValueError:
        raise SystemExit(f"--speculative_tokens: expected an integer, got {tokens!r}") from None
    try:
        check(method, count, "vllm", servers=False)
    except SpeculativeError as exc:
        raise SystemExit(f"--{exc}") from None
    if any(flag_name(a) == "--speculative-config" for a in argv):
        raise SystemExit("--speculative: give either it or vLLM's --speculative-config, not both")
    return argv + ["--speculative-config", json.dumps(vllm_config(method, count))]


def run_summary(method: str, num_tokens: int, stats: dict) -> dict:
    """The run summary's "speculative" section: the method and, with speculation, its counters from the pipeline's
    stats (`pipeline/records.py`); {"method": "off"} without."""
    out = {"method": method}
    if method != "off":
        out["num_speculative_tokens"] = num_tokens
        out.update({k.removeprefix("generator/spec_"): v for k, v in stats.items() if k.startswith("generator/spec_")})
    return out


def summary_line(section: dict) -> str | None:
    """The printed summary's line for `run_summary`'s section (None: no speculation)."""
    if section.get("method", "off") == "off":
        return None
    return (f"speculative {section['method']} ({section['num_speculative_tokens']} draft tokens): acceptance "
            f"{section.get('acceptance_rate', 0):.2f} | mean accepted length {section.get('mean_accepted_length', 0):.2f} "
            f"| drafted {section.get('drafted_tokens', 0):.0f} tokens, wasted {section.get('wasted_tokens', 0):.0f}")
