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
