"""The built-in task: deterministic splits, a gold reward that ranks sensibly, the local tokenizer."""

import random

import pytest
from transformers import AutoTokenizer

from async_rlhf.data import builtin_task as bt
from async_rlhf.data.tokenizer import build_tokenizer

SIZES = {"train": 64, "validation": 16, "test": 32}


def test_splits_are_deterministic_per_seed_and_differ_across_seeds():
    a = bt.make_splits(seed=3, sizes=SIZES)
    b = bt.make_splits(seed=3, sizes=SIZES)
    c = bt.make_splits(seed=4, sizes=SIZES)
    for split in SIZES:
        assert a[split].to_list() == b[split].to_list()
        assert len(a[split]) == SIZES[split]
    assert a["train"]["prompt"] != c["train"]["prompt"]
    assert a["train"]["prompt"] != a["test"]["prompt"]  # splits draw from their own streams
    # a split's rows do not depend on the other splits' sizes
    assert bt.make_splits(seed=3, sizes={"train": 5, "validation": 0, "test": 32})["test"].to_list() == \
        a["test"].to_list()


def test_plain_and_conversational_formats_hold_the_same_rows():
    plain = bt.make_splits(seed=0, sizes=SIZES)["train"]
    chat = bt.make_splits(seed=0, conversational=True, sizes=SIZES)["train"]
    assert set(plain.column_names) == {"prompt", "completion", "reference"}
    row = chat[0]
    assert row["prompt"] == [{"role": "user", "content": plain[0]["prompt"]}]
    assert row["completion"] == [{"role": "assistant", "content": plain[0]["completion"].strip()}]
    assert row["reference"] == plain[0]["reference"]


def test_gold_reward_ranks_ideal_over_references_over_random_text():
    rng = random.Random(0)
    posts = [bt.sample_post(rng) for _ in range(300)]
    prompts = [p.prompt for p in posts]
    ideal = bt.gold_reward(prompts, [bt.ideal_summary(p) for p in posts])
    references = bt.gold_reward(prompts, [bt.noisy_summary(p, bt.REFERENCE_NOISE, rng) for p in posts])
    demos = bt.gold_reward(prompts, [bt.noisy_summary(p, bt.DEMONSTRATION_NOISE, rng) for p in posts])
    random_text = bt.gold_reward(prompts, [" " + " ".join(rng.choices(bt.VOCABULARY, k=6)) + "." for _ in posts])
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(ideal) > mean(references) > mean(demos) > mean(random_text)
    assert all(i >= r - 1e-9 for i, r in zip(ideal, references))  # the oracle's noise never helps
    # continuous, not 0/1
    assert len({round(x, 3) for x in references}) > 10


def test_gold_reward_penalises_rambling_and_rewards_a_clean_stop():
    post = bt.Post("pets", ("my", "cat", "and", "the", "vet", "cat", "so", "vet", "dog"))
    prompt = post.prompt
    assert post.key_words == ["cat", "vet"]
    clean, no_stop, ramble, truncated = bt.gold_reward(
        [prompt] * 4, [" cat vet.", " cat vet", " cat vet. my cat and the vet so my cat dog and", " cat vet."],
        truncated=[False, False, False, True])
    assert clean > no_stop and clean > truncated and clean > ramble
    assert ramble < clean - 0.5
    # chat-format completions score the same as text
    assert bt.gold_reward([[{"role": "user", "content": prompt}]],
                          [[{"role": "assistant", "content": "cat vet."}]]) == [clean]


def test_tokenizer_round_trips_saves_and_has_pad_eos_and_chat_template(tmp_path):
    tok = build_tokenizer()
    for word in bt.VOCABULARY:
        assert len(tok(" " + word, add_special_tokens=False)["input_ids"]) == 1
    text = bt.make_splits(seed=0, sizes=SIZES)["train"][0]["prompt"] + " cat vet."
    # add_prefix_space: a text that does not start with a space decodes with one
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == " " + text
    assert tok.decode(tok(" cat vet.", add_special_tokens=False)["input_ids"]) == " cat vet."
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.pad_token == "<|pad|>" and loaded.eos_token == "<|endoftext|>"
    assert loaded.pad_token_id != loaded.eos_token_id
    rendered = loaded.apply_chat_template([{"role": "user", "content": "POST: cat\nTL;DR:"}],
                                          add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|assistant|>")
    # plain and chat completions become the same tokens (the SFT model serves both formats)
    plain = loaded(" cat vet.", add_special_tokens=False)["input_ids"]
    chat = loaded("<|assistant|>cat vet.", add_special_tokens=False)["input_ids"][1:]
    assert plain == chat


@pytest.mark.parametrize("split", ["train", "test"])
def test_references_are_good_but_beatable(split):
    rows = bt.make_splits(seed=0, sizes={"train": 400, "validation": 0, "test": 400})[split]
    ideal = []
    for prompt in rows["prompt"]:
        words = bt._post_words(prompt)
        ideal.append(bt.ideal_summary(bt.Post("x", tuple(words))))
    ideal_scores = bt.gold_reward(rows["prompt"], ideal)
    ref_scores = bt.gold_reward(rows["prompt"], rows["reference"])
    win = sum(i > r for i, r in zip(ideal_scores, ref_scores)) / len(rows)
    assert 0.2 < win < 0.8  # the ideal policy beats the references often, but they are right much of the time
