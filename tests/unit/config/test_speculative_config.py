"""`speculative` (issue 34): refused before any engine starts where it cannot run, naming the option and the fix;
the server launcher's `--speculative`; the history proposer's drafts and its memory bound (without vLLM: it is our
code, fed the arrays vLLM's model runner passes it)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from async_rlhf.config import speculative
from async_rlhf.errors import ConfigError
from async_rlhf.experimental.speculative import history_proposer
from async_rlhf.config.speculative import server_argv as speculative_argv


@pytest.mark.parametrize("fields, words", [
    ({"speculative": "eagle"}, ["speculative", "'eagle'", "ngram"]),
    ({"speculative": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens", "[1, 16]", "0"]),
    ({"speculative": "ngram", "num_speculative_tokens": 17}, ["num_speculative_tokens", "17"]),
    ({"speculative": "ngram", "generator_backend": "transformers"}, ["speculative", "generator_backend='transformers'",
                                                                       "generator_backend='vllm'"]),
    ({"speculative": "history", "generator_servers": ["127.0.0.1:8000"]}, ["speculative", "--speculative history"]),
    ({"speculative": "ngram", "weight_load": "in_flight"}, ["speculative", "weight_load='drain'", "'in_flight'"]),
    ({"speculative": "ngram", "min_p": 0.1}, ["speculative", "min_p=0.1"]),
])
def test_refused_with_the_option_named(make_config, fields, words):
    with pytest.raises(ConfigError) as info:
        make_config(**fields)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_missing_package_is_named(make_config, monkeypatch):
    monkeypatch.setattr(speculative, "suffix_available", lambda: False)
    with pytest.raises(ConfigError, match="arctic-inference"):
        make_config(speculative="suffix")


def test_accepted_settings(make_config):
    assert make_config(speculative="history", num_speculative_tokens=8).speculative == "history"
    assert make_config().speculative == "off"


def test_server_flags_become_vllms_config():
    argv = speculative_argv(["--model", "m", "--speculative", "history", "--speculative_tokens", "6"])
    assert argv[:2] == ["--model", "m"] and argv[2] == "--speculative-config"
    assert '"custom_class"' in argv[3] and '"num_speculative_tokens": 6' in argv[3]
    assert speculative_argv(["--model", "m"]) == ["--model", "m"]
    with pytest.raises(SystemExit, match="num_speculative_tokens"):
        speculative_argv(["--speculative", "ngram", "--speculative_tokens", "99"])


def _proposer(k=3, max_tokens=1000):
    config = types.SimpleNamespace(speculative_config=types.SimpleNamespace(num_speculative_tokens=k),
                                   model_config=types.SimpleNamespace(max_model_len=64))
    return history_proposer.HistoryProposer(config, max_tokens=max_tokens)


def _step(proposer, rows: list[list[int]], sampled: list[list[int]]):
    table = np.zeros((len(rows), 64), dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, :len(r)] = r
    return proposer.propose(sampled, np.array([len(r) for r in rows]), table)


def test_history_drafts_what_an_earlier_completion_of_the_prompt_did():
    p = _proposer()
    prompt = [5, 6, 7]
    done = prompt + [20, 21, 22, 23, 24, 25]
    for n in range(4, len(done) + 1):  # an earlier sample, one token per step
        _step(p, [done[:n]], [[done[n - 1]]])
    # a new sample of the same prompt in another row: after [20, 21] it is offered what followed before
    drafts = _step(p, [[1, 2, 3], prompt + [20, 21]], [[3], [21]])
    assert drafts[1] == [22, 23, 24]
    assert _step(p, [[9, 9, 9, 8]], [[]]) == [[]]  # nothing sampled yet (a prefill): no draft


def test_history_memory_is_bounded():
    p = _proposer(max_tokens=50)
    for s in range(20):  # 20 sequences of 10 tokens, each in a row of its own
        _step(p, [[100 + s] + list(range(s, s + 9))], [[s + 8]])
    assert p._kept <= 50 and len(p._seqs) <= 5
    assert len(p._index) <= 2 * len(history_proposer.NGRAMS) * 50


def test_auto_turns_speculation_on_only_where_it_pays():
    from async_rlhf.experimental.speculative.choice import choose

    off = {"tokens_per_s": 100.0}
    assert choose({"off": off, "ngram": {"tokens_per_s": 104.0, "accepted_length": 0.1}}) == "off"  # < 1.05x
    assert choose({"off": off, "ngram": {"tokens_per_s": 90.0}, "history": {"tokens_per_s": 150.0}}) == "history"
    assert choose({"off": off, "history": {"error": "exit 1"}}) == "off"
    assert choose({"off": {"error": "exit 1"}, "ngram": {"tokens_per_s": 150.0}}) == "off"
