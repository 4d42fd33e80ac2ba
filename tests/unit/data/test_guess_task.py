"""The guessing task's pieces (`data/guess_task.py`, `data/tool_tokenizer.py`, `data/tool_episodes.py`): the
tokenizer passes TRL 1.16's checks and its parser reads a tool call; the template is prefix-preserving; the
environment's answers and budget; random guessing without repeats at chance (5/16), binary search 16/16; the control
uninformative; episodes token in, token out; factories that pickle."""

from __future__ import annotations

import functools
import pickle
import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from trl.chat_template_utils import (
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
    supports_tool_calling,
)

from async_rlhf.data import guess_task as g
from async_rlhf.data.tool_episodes import TurnTokens, environment_tools, run_episodes


@functools.lru_cache(maxsize=1)
def tokenizer():
    return g.build_tokenizer()


def call(n) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}]}


def test_tokenizer_passes_trls_checks_and_trls_parser_reads_a_call():
    tok = tokenizer()
    assert supports_tool_calling(tok) and is_chat_template_prefix_preserving(tok)
    assert get_training_chat_template(tok) is None  # prefix-preserving, generation markers: nothing to patch
    env = g.GuessEnv()
    prompt = tok.apply_chat_template([{"role": "user", "content": g.PROMPT}], tools=[env.guess], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    sampled = TurnTokens(tok).assistant(call(11))
    assert sampled[-1] == tok.eos_token_id and tok.convert_ids_to_tokens(sampled[0]) == "<tool_call>"
    parsed = parse_response(tok, sampled, prefix=prompt, tools=[env.guess])
    assert parsed["tool_calls"] == [{"type": "function", "function": {"name": "guess", "arguments": {"n": 11}}}]
    assert parse_response(tok, TurnTokens(tok).assistant({"role": "assistant", "content": g.found_message(3)}),
                          prefix=prompt, tools=[env.guess]) == {"role": "assistant", "content": "The number is 3."}
    # every answer and number is one token; text outside the vocabulary still round-trips (byte fallback)
    for word in (g.HIGHER, g.LOWER, g.CORRECT, *map(str, g.NUMBERS)):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1
    assert tok.decode(tok("ünïcode {\"n\": 99}", add_special_tokens=False)["input_ids"]) == "ünïcode {\"n\": 99}"


def test_a_whitespace_word_tokenizer_passes_the_checks_but_never_parses_a_call():
    """Why the vocabulary has characters: TRL's parser reads decoded text, which must keep newlines and spaces."""
    words = sorted({w for text in g.tokenizer_corpus() for w in text.split()})
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # joins words with spaces
    plain = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>")
    plain.chat_template, plain.response_template = tokenizer().chat_template, tokenizer().response_template
    assert supports_tool_calling(plain) and is_chat_template_prefix_preserving(plain)
    text = plain.apply_chat_template([{"role": "user", "content": "x"}, call(11)], tokenize=False)
    sampled = plain(text.split("<|im_start|>assistant\n", 1)[1], add_special_tokens=False)["input_ids"]
    assert "tool_calls" not in parse_response(plain, sampled)


def test_trls_grpo_trainer_accepts_the_tokenizer_and_the_environment_and_cuts_tool_answers_as_we_do(tmp_path,
                                                                                                   monkeypatch):
    from trl import GRPOConfig, GRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is experimental in TRL 1.16

    from async_rlhf.data.tiny_model import tiny_llama

    tok = tokenizer()
    trainer = GRPOTrainer(model=tiny_llama(tok, 16, 1, 1), processing_class=tok, environment_factory=g.GuessEnv,
                          train_dataset=g.make_split(4, 0, "train"),
                          args=GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                          num_generations=2, max_completion_length=16, report_to=[], use_cpu=True))
    assert trainer.chat_template is None  # TRL found the template prefix-preserving: it keeps ours
    assert trainer.reward_func_names == ["GuessEnv"] and [t.__name__ for t in trainer.tools] == ["guess"]
    for content in (g.HIGHER, g.CORRECT, "{'error': 'x'}"):
        answer = [{"role": "tool", "name": "guess", "content": content}]
        assert TurnTokens(tok).tool_suffix(answer) == trainer._get_tool_suffix_ids(answer)


def test_environment_answers_and_budget():
    env = g.GuessEnv()
    assert env.reset(secret=9, seed=3, prompt=[]) is None  # TRL passes the whole row; nothing is appended
    assert [t.__name__ for t in environment_tools(env)] == ["guess"]
    assert [env.guess(n) for n in (3, 12)] == [g.HIGHER, g.LOWER] and env.get_reward() == 0.0
    assert env.guess(9) == g.CORRECT and env.solved and env.get_reward() == 1.0
    assert env.guess(9) == g.OVER and env.guesses == [3, 12, 9]  # the episode is over: not counted
    env.reset(secret=0)
    assert [env.guess(n) for n in range(1, 6)] == [g.LOWER] * 5
    assert env.guess(0) == g.OVER and not env.solved and env.get_reward() == 0.0  # 5 guesses spent
    with pytest.raises(TypeError, match="integer"):
        env.guess("7")


def test_random_guessing_is_at_chance_and_binary_search_always_wins():
    rows = list(g.make_split(1600, 0, "test"))
    rng = random.Random(0)
    wins = [g.play(g.GuessEnv(), r, g.random_guess_without_repeats, rng).solved for r in rows]
    assert sum(wins) / len(wins) == pytest.approx(g.CHANCE, abs=0.04)  # 5/16; 1 sd is 0.012
    for secret in g.NUMBERS:
        env = g.play(g.GuessEnv(), {"secret": secret}, g.binary_search_guess, rng)
        assert env.solved and len(env.guesses) <= g.MAX_GUESSES


def test_the_control_is_uninformative():
    a, b = g.UninformativeGuessEnv(), g.UninformativeGuessEnv()
    a.reset(secret=2, seed=7)
    b.reset(secret=13, seed=7)
    guesses = [8, 0, 15, 5, 11]  # neither secret
    assert [a.guess(n) for n in guesses] == [b.guess(n) for n in guesses]  # the same answers, whatever the secret
    rows = list(g.make_split(1600, 0, "test"))
    for policy in (g.binary_search_guess, g.random_legal_guess):
        wins = [g.play(g.UninformativeGuessEnv(), r, policy, random.Random(i)).solved for i, r in enumerate(rows)]
        assert sum(wins) / len(wins) == pytest.approx(g.CHANCE, abs=0.04)


def test_factories_pickle():
    for factory in g.ENVIRONMENTS.values():
        env = pickle.loads(pickle.dumps(factory))()
        env.reset(secret=4, seed=1)
        env.guess(2)
        copy = pickle.loads(pickle.dumps(env))
        assert copy.guesses == [2] and copy.guess(4) == g.CORRECT


def test_splits_are_deterministic_and_the_held_out_one_balanced():
    a, b = g.make_splits(3, sizes={"train": 40, "test": 48}), g.make_splits(3, sizes={"train": 40, "test": 48})
    assert a["train"].to_list() == b["train"].to_list() and a["test"].to_list() == b["test"].to_list()
    assert a["train"]["secret"] != g.make_splits(4, sizes={"train": 40})["train"]["secret"]
    assert sorted(a["test"]["secret"]) == sorted(list(g.NUMBERS) * 3)
    assert a["test"][0]["prompt"] == [{"role": "user", "content": g.PROMPT}]


def test_episodes_are_token_in_token_out():
    """Each turn's prompt is the previous prompt + the sampled ids + the tool answer's ids rendered alone. The
    sampler here says its guesses with a *non-canonical* tokenization (the number spelt digit by digit): decoding
    and encoding again would give other ids, so only an exact token-in-token-out loop keeps them."""
    tok = tokenizer()
    turns = TurnTokens(tok)
    sampled_log = []

    def sample(episodes, budgets):
        out = []
        for e in episodes:
            message = g.next_message(e.env, g.binary_search_guess, random.Random(0))
            ids = turns.assistant(message)
            if "tool_calls" in message:  # "11" -> "1", "1": the same text, other ids
                number = str(message["tool_calls"][0]["function"]["arguments"]["n"])
                canonical = tok.convert_tokens_to_ids(number)
                at = ids.index(canonical)
                ids = ids[:at] + tok.convert_tokens_to_ids(list(number)) + ids[at + 1:]
            sampled_log.append((id(e), ids))
            out.append((ids, [-0.5] * len(ids)))
        return out

    rows = list(g.make_split(16, 0, "test"))
    episodes = run_episodes(tok, [g.GuessEnv() for _ in rows], rows, sample, 256, g.MAX_GUESSES, turns)
    assert all(e.env.solved and e.finish == "answered" for e in episodes)
    assert any(len(ids) > len(turns.assistant(call(0))) for _, ids in sampled_log)  # some were spelt out
    for e in episodes:
        mine = [ids for owner, ids in sampled_log if owner == id(e)]
        assert len(mine) == e.turns == len(e.env.guesses) + 1
        for t in range(e.turns - 1):
            answer = [{"role": "tool", "name": "guess", "content": e.env.answers[t]}]
            assert e.turn_prompts[t + 1] == e.turn_prompts[t] + mine[t] + turns.tool_suffix(answer)
        assert e.prompt_ids + e.completion_ids == e.turn_prompts[-1] + mine[-1]
        assert [t for t, m in zip(e.completion_ids, e.mask) if m] == [t for ids in mine for t in ids]
        assert [lp for lp, m in zip(e.logprobs, e.mask) if m] == [-0.5] * sum(e.mask)
        assert all(lp == 0.0 for lp, m in zip(e.logprobs, e.mask) if not m)
    # with canonical ids the episode is exactly the template's rendering of the conversation (prefix-preserving)
    demo = run_episodes(tok, [g.GuessEnv()], rows[:1], g.scripted_sampler(turns, g.random_legal_guess,
                                                                          random.Random(1)), 256, g.MAX_GUESSES)[0]
    whole = tok.apply_chat_template(rows[0]["prompt"] + demo.messages, tools=demo.tools, tokenize=True,
                                    return_dict=False)
    ids = demo.prompt_ids + demo.completion_ids
    assert whole[:len(ids)] == ids and tok.decode(whole[len(ids):]) == "\n"


def test_tool_errors_are_answered_and_the_budget_rolls_back_an_overflowing_answer():
    tok = tokenizer()
    turns = TurnTokens(tok)
    bad = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "guess", "arguments": {"n": "seven"}}},
        {"type": "function", "function": {"name": "peek", "arguments": {}}}]}

    def sample(episodes, budgets):
        ids = [turns.assistant(bad if e.tool_calls == 0 else call(3)) for e in episodes]
        return [(i, [0.0] * len(i)) for i in ids]

    rows = list(g.make_split(1, 0, "test"))
    e = run_episodes(tok, [g.GuessEnv()], rows, sample, 256, 1, turns)[0]
    assert (e.tool_calls, e.tool_failures, e.finish) == (2, 2, "iterations")
    assert [m["content"] for m in e.messages if m["role"] == "tool"] == [
        str({"error": "n must be an integer, got 'seven'"}), str({"error": "Tool peek not found."})]
    short = run_episodes(tok, [g.GuessEnv()], rows, lambda es, b: [(turns.assistant(call(3)), [0.0] * 17)] * len(es),
                         len(turns.assistant(call(3))) + 2, 5, turns)[0]
    assert short.finish == "length" and short.mask == [1] * len(short.completion_ids)  # the answer rolled back
    assert short.messages[-1]["role"] == "assistant" and short.env.guesses == [3]
