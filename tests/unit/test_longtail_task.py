"""The long-tail task (`data/longtail_task.py`): heavy-tailed target lengths as claimed, a gold reward for which
length matters, its own tokenizer, a reduced build through the built-in task's cache code, and `--task longtail`
(and the toy task's `--toy_lengths`) where recipes pick a task."""

from __future__ import annotations

import json
import os
import random
import statistics

import pytest

from async_rlhf.config.cli import parse_args
from async_rlhf.errors import ConfigError
from async_rlhf.data import longtail_task as lt
from async_rlhf.tasks import build_builtin as prepare
from async_rlhf.data.tokenizer import build_tokenizer
from async_rlhf.tasks.setup import ScriptArguments, setup_task, task_defaults

TINY_SFT = prepare.SFTSettings(num_examples=64, steps=3, batch_size=8, hidden_size=32, num_layers=1, num_heads=1,
                               length_grouped=True)
TINY_RM = prepare.RewardModelSettings(num_pairs=16, num_eval_pairs=8, max_new_tokens=4, batch_size=4,
                                      sort_prompts=True)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(vocabulary=lt.VOCABULARY)


def test_splits_are_deterministic_and_every_item_is_said_once():
    a = lt.make_splits(seed=0, sizes={"train": 32, "validation": 0, "test": 16})
    assert a["train"].to_list() == lt.make_split(32, 0, "train").to_list()
    assert a["train"]["prompt"] != lt.make_split(32, 1, "train")["prompt"]
    rng = random.Random(0)
    for _ in range(200):
        post = lt.sample_post(rng)
        assert len(post.items) == len(set(post.items)) >= 1
        assert lt.ideal_summary(post) == " " + " ".join(post.items) + "."
        assert " ".join(post.items) in post.prompt


def test_target_lengths_are_heavy_tailed_as_claimed(tokenizer):
    """Ideal summaries of 4096 posts, in tokens with EOS: mean about 18, coefficient of variation near 1 (0.8-1.1),
    the longest several times the mean and within the 256-token budget; the longest of 16 samples (one step's
    prompts of a small batch) is on average about three times the mean, the issue's long-tail shape."""
    rng = random.Random(0)
    posts = [lt.sample_post(rng) for _ in range(4096)]
    lengths = [len(tokenizer(lt.ideal_summary(p), add_special_tokens=False)["input_ids"]) + 1 for p in posts]
    assert lengths == [len(p.items) + 2 for p in posts]  # one token per word, the period, EOS
    mean = statistics.mean(lengths)
    cv = statistics.pstdev(lengths) / mean
    assert 16 < mean < 20 and 0.8 < cv < 1.1, (mean, cv)
    assert 6 * mean < max(lengths) <= lt.MAX_NEW_TOKENS
    longest_of_16 = statistics.mean(max(lengths[i:i + 16]) for i in range(0, 4096, 16))
    assert longest_of_16 > 2.8 * mean, (longest_of_16, mean)


def test_task_words_are_single_tokens_and_the_builtin_tokenizer_is_unchanged(tokenizer):
    for word in lt.VOCABULARY:
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1
    default = build_tokenizer()
    assert len(default) < len(tokenizer)
    hamster = " hamster"  # not a built-in task word: several tokens there, one here
    assert len(default.encode(hamster, add_special_tokens=False)) > 1


def test_gold_reward_makes_length_matter():
    rng = random.Random(1)
    posts = [p for p in (lt.sample_post(rng) for _ in range(400)) if len(p.items) >= 6][:100]
    prompts = [p.prompt for p in posts]
    ideal = [lt.ideal_summary(p) for p in posts]
    too_short = [lt.render(p.items[:len(p.items) // 2]) for p in posts]
    too_long = [lt.render(p.items + p.items[:3]) for p in posts]  # repeats after the list
    cut = [" " + " ".join(p.items[:-1]) for p in posts]  # cut at the token limit: no period
    score = lambda texts, **kw: lt.gold_reward(prompts, texts, **kw)  # noqa: E731
    best = score(ideal)
    for worse in (score(too_short), score(too_long), score(cut), score(ideal, truncated=[True] * len(posts))):
        assert all(w < b for w, b in zip(worse, best))
    # the ideal list of 3 items, in any order: 2 + 0.3 - 3 x 0.005; an opener costs 0.3 + 0.005
    words = ["my", "so", "cat", "vet", "food"]
    assert lt.score(words, " cat vet food.") == lt.score(words, " food cat vet.") == pytest.approx(2.285)
    assert lt.score(words, " my cat vet food.") == pytest.approx(2.285 - 0.3 - 0.005)


def test_references_and_demonstrations_leave_room_for_rlhf():
    test = lt.make_split(512, 0, "test")
    posts = [lt.Post("x", tuple(lt.post_words(p))) for p in test["prompt"]]
    refs = lt.gold_reward(test["prompt"], test["reference"])

    def win_rate(texts):
        return statistics.mean((a > b) + 0.5 * (a == b) for a, b in zip(lt.gold_reward(test["prompt"], texts), refs))

    assert 0.7 < win_rate([lt.ideal_summary(p) for p in posts]) < 0.9  # the ideal beats most references
    assert 0.2 < win_rate(test["completion"]) < 0.4  # the demonstrations' house style loses to most


def test_reduced_build_and_the_recipe_flag(tmp_path, monkeypatch):
    """A reduced build into the default cache directory of a temporary cache root (seconds), then `--task longtail`
    as a recipe parses it: the task's defaults, its SFT policy and proxy reward model, its train split, and an
    evaluation with its gold reward and 256-token completions, also against the SFT policy's cached greedy
    completions."""
    from async_rlhf.config import algorithms as c
    from async_rlhf.tasks.build_longtail import prepare_longtail

    monkeypatch.setenv("ASYNC_RLHF_CACHE", str(tmp_path / "cache"))
    real = prepare.evaluate_policy
    monkeypatch.setattr(prepare, "evaluate_policy", lambda *a, **k: real(*a, **{**k, "num_prompts": 8}))
    paths = prepare_longtail(sft=TINY_SFT, reward=TINY_RM)
    assert paths["cache_dir"] == str(tmp_path / "cache" / f"longtail-v{lt.TASK_VERSION}")
    manifest = json.load(open(paths["manifest"]))
    assert manifest["task"] == "longtail" and manifest["task_version"] == lt.TASK_VERSION
    assert manifest["sft_settings"]["length_grouped"] and manifest["reward_model_settings"]["sort_prompts"]
    sft_config = json.load(open(os.path.join(paths["sft_model"], "config.json")))
    assert sft_config["max_position_embeddings"] == lt.SFT_MAX_POSITIONS
    assert sft_config["vocab_size"] == len(build_tokenizer(vocabulary=lt.VOCABULARY))

    script, config = parse_args((ScriptArguments, c.AsyncOnlineDPOConfig),
                                ["--task", "longtail", "--eval_prompts", "4", "--output_dir", str(tmp_path / "out")],
                                task_defaults("online_dpo"))
    assert (config.max_new_tokens, config.max_length) == (lt.MAX_NEW_TOKENS, 512)
    task = setup_task(script, config)
    assert task.model == paths["sft_model"] and task.reward == paths["reward_model"]
    assert task.train_dataset["prompt"][:4] == lt.make_split(4, 0, "train")["prompt"]
    results = task.evaluate(paths["sft_model"])
    assert results["num_prompts"] == 4 and results["kl"] == pytest.approx(0.0, abs=1e-4)
    assert 0 < results["completion_tokens_mean"] <= lt.MAX_NEW_TOKENS
    # win-rate vs the SFT policy's greedy completions: the SFT policy ties with itself on every prompt
    assert results["gold_win_rate_vs_sft"] == 0.5 and results["sft_gold_reward"] == results["gold_reward"]
    cached = os.path.join(paths["cache_dir"], "eval", "sft_greedy_4.json")
    data = json.load(open(cached))
    assert len(data["completions"]) == 4 and data["key"]["max_new_tokens"] == lt.MAX_NEW_TOKENS
    # later evaluations read the cached completions, not new ones: worse cached completions, a higher win-rate
    for c in data["completions"]:
        c["completion"], c["truncated"] = " ".join(["zzz"] * 1000), True
    json.dump(data, open(cached, "w"))
    assert setup_task(script, config).evaluate(paths["sft_model"])["gold_win_rate_vs_sft"] == 1.0
    # a cache made for other prompts is regenerated
    data["key"]["prompts_sha256"] = "other"
    json.dump(data, open(cached, "w"))
    assert setup_task(script, config).evaluate(paths["sft_model"])["gold_win_rate_vs_sft"] == 0.5
    script.reward = "gold"
    assert setup_task(script, config).reward is lt.gold_reward


def test_toy_lengths_flag_gives_heavy_tailed_budgets_and_refuses_bad_values(tmp_path):
    from async_rlhf.config import algorithms as c

    argv = ["--task", "toy", "--toy_lengths", "48", "1.0", "--max_new_tokens", "224", "--max_length", "256",
            "--output_dir", str(tmp_path)]
    script, config = parse_args((ScriptArguments, c.AsyncOnlineDPOConfig), argv, task_defaults("online_dpo"))
    budgets = setup_task(script, config).train_dataset["max_new_tokens"]
    assert max(budgets) <= 224 and statistics.pstdev(budgets) / statistics.mean(budgets) > 0.7
    script.toy_lengths = [48]
    with pytest.raises(ConfigError, match=r"toy_lengths: expected 'MEAN CV'.*\[48\]"):
        setup_task(script, config)
