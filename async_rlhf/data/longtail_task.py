"""The long-tail task: the built-in task's prompt format and roles, with summaries whose lengths are heavy-tailed.

Real summarisation workloads have heavy-tailed response lengths (TL;DR summaries 10-60 tokens, reasoning traces far
longer); the built-in task's summaries are all 3-5 tokens, so generation never waits on a long tail there. Here a
post names `n` distinct things (content words) in a run, between a few filler words, and a good summary lists all
of them, each once, in any order, and stops:

    SUBREDDIT: r/travel
    POST: it and got ticket flight jetlag museum luggage now just
    TL;DR: ticket flight jetlag museum luggage.

`n` is drawn from a lognormal with mean `MEAN_ITEMS` (16) and coefficient of variation `ITEMS_CV` (1.0), clipped to
[1, `MAX_ITEMS`] (every content word: 192); a summary of `n` items is n + 1 tokens (one per word, and the period)
plus EOS, so target lengths run from 3 to 194 tokens (200 with a ramble), mean 18, coefficient of variation 0.89,
and the longest of 16 is on average 3.3x the mean. Short posts stay on their subreddit's topic; long ones wander
into other topics.

Why any order: a summary in the post's order is a copy, which needs induction heads; the built-in task's
1.2M-parameter policy, trained for a build's budget, did not form them (500-1200 steps of 32 examples: the right
number of words, on-topic, at random). In any order it needs only which words the post names and which it has
written; docs/longtail_task.md has what the shipped SFT policy does learn (the lengths) and does not (the
content, yet).

The roles are the built-in task's (`data/builtin_task.py`): a programmatic gold reward; noisy human references
(careless content: a dropped item, a repeat); SFT demonstrations careful about content with a house style
the gold reward dislikes (most open with a filler word, some ramble on). Length matters to the gold reward: every
item left out costs recall, every word too many costs a penalty, and only a summary that stops after its last
item (EOS right after the period) gets the clean-ending bonus, so a completion cut at the token limit loses.

Deterministic given `seed`, like the built-in task. Bump `TASK_VERSION` when the generator or the reward changes:
the cached models (`tasks/build_longtail.py`) are keyed by it.
"""

from __future__ import annotations

import functools
import math
import random
from collections import Counter
from dataclasses import dataclass

from datasets import Dataset, DatasetDict

from async_rlhf.data.builtin_task import FILLERS, PROMPT_TEMPLATE, TOPICS, _post_words, _text, split_rows

TASK_VERSION = 1
NAME = "longtail"

# Each topic: the built-in task's twelve words and twelve more, so a post can mention up to MAX_ITEMS distinct ones.
MORE_WORDS: dict[str, tuple[str, ...]] = {
    "relationships": ("kiss", "fight", "sister", "brother", "mom", "dad", "couple", "crush", "ex", "roommate",
                      "family", "letter"),
    "pets": ("hamster", "rabbit", "collar", "tank", "litter", "bowl", "treat", "groomer", "kennel", "turtle", "parrot",
             "yard"),
    "work": ("client", "desk", "laptop", "overtime", "resume", "intern", "schedule", "report", "payroll", "hr",
             "raise", "layoff"),
    "money": ("invoice", "wallet", "cash", "stocks", "pension", "insurance", "refund", "fees", "coins", "lender",
              "account", "interest"),
    "gaming": ("quest", "loot", "mod", "lobby", "ranked", "pc", "keyboard", "mouse", "arcade", "dungeon", "sword",
               "avatar"),
    "cooking": ("onion", "salt", "pepper", "cheese", "egg", "flour", "stove", "fridge", "grill", "noodles", "spoon",
                "chicken"),
    "fitness": ("bike", "treadmill", "cardio", "pushup", "plank", "trainer", "sprint", "swim", "muscle", "vitamins",
                "mat", "helmet"),
    "travel": ("hostel", "cruise", "ticket", "border", "suitcase", "camera", "museum", "ferry", "subway", "guide",
               "souvenir", "jetlag"),
}
WORDS: dict[str, tuple[str, ...]] = {t: TOPICS[t] + MORE_WORDS[t] for t in sorted(TOPICS)}
CONTENT_WORDS: frozenset[str] = frozenset(w for words in WORDS.values() for w in words)
VOCABULARY: tuple[str, ...] = tuple(sorted(CONTENT_WORDS)) + FILLERS
assert len(CONTENT_WORDS) == sum(len(w) for w in WORDS.values()) and not CONTENT_WORDS & set(FILLERS)

MEAN_ITEMS = 16.0  # mean number of items (content words) per post: summaries of about 18 tokens on average
ITEMS_CV = 1.0  # coefficient of variation of the number of items (lognormal), the heavy tail
MAX_ITEMS = len(CONTENT_WORDS)  # 192 items: a summary of 194 tokens with its period and EOS, 200 with a ramble
MAX_NEW_TOKENS = 256
SFT_MAX_POSITIONS = 640  # the policy's context: the longest post (about 270 tokens) and its summary fit with room
DEFAULT_SIZES = {"train": 8192, "validation": 512, "test": 512}


@dataclass(frozen=True)
class ListNoise:
    """How a noisy summariser deviates from the ideal list. Probabilities are per summary unless noted."""

    drop_item: float  # each item is left out with this probability (at least one is kept)
    repeat: float  # one item is said a second time, right after itself
    add_filler: float  # one filler word from the post is inserted at a random place
    opener: float  # the summary starts with the post's first filler word
    ramble: float  # one to three post words are appended after the items


# References: no house style, careless content (about one list in two has a flaw; long lists drop more items).
REFERENCE_NOISE = ListNoise(drop_item=0.03, repeat=0.3, add_filler=0.0, opener=0.0, ramble=0.0)
# Demonstrations: careful content, the built-in task's house style (opener 60%, ramble 15%), which the gold reward
# dislikes and RLHF can learn to drop.
DEMONSTRATION_NOISE = ListNoise(drop_item=0.005, repeat=0.02, add_filler=0.05, opener=0.6, ramble=0.15)


def lognormal_count(rng: random.Random, mean: float = MEAN_ITEMS, cv: float = ITEMS_CV, cap: int = MAX_ITEMS) -> int:
    """A whole number from a lognormal with this mean and coefficient of variation, clipped to [1, cap]."""
    sigma = math.sqrt(math.log(1 + cv * cv))  # cv^2 = exp(sigma^2) - 1
    mu = math.log(mean) - sigma * sigma / 2  # mean = exp(mu + sigma^2 / 2)
    return min(cap, max(1, round(rng.lognormvariate(mu, sigma))))


@dataclass(frozen=True)
class Post:
    topic: str
    words: tuple[str, ...]

    @property
    def items(self) -> list[str]:
        """The content words, in the post's order (each is said once)."""
        return [w for w in self.words if w in CONTENT_WORDS]

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(topic=self.topic, post=" ".join(self.words))


def sample_post(rng: random.Random) -> Post:
    """`n` distinct content words (lognormal count), the topic's own first, in a run between two to five filler
    words before and one to four after."""
    topic = rng.choice(sorted(WORDS))
    own = list(WORDS[topic])
    others = [w for t in sorted(WORDS) if t != topic for w in WORDS[t]]
    rng.shuffle(own)
    rng.shuffle(others)
    items = (own + others)[:lognormal_count(rng)]
    before = rng.choices(FILLERS, k=rng.randint(2, 5))
    after = rng.choices(FILLERS, k=rng.randint(1, 4))
    return Post(topic, tuple(before + items + after))


def render(words: list[str]) -> str:
    """Completion text as the model writes it after "TL;DR:": " a b c." (a leading space, the list, a period)."""
    return " " + " ".join(words) + "."


def noisy_summary(post: Post, noise: ListNoise, rng: random.Random) -> str:
    items = post.items
    words = [w for w in items if rng.random() >= noise.drop_item] or [rng.choice(items)]
    rng.shuffle(words)  # any order is right (see the module docstring)
    if rng.random() < noise.repeat:
        i = rng.randrange(len(words))
        words.insert(i + 1, words[i])
    fillers = [w for w in dict.fromkeys(post.words) if w not in CONTENT_WORDS] or list(FILLERS)
    if rng.random() < noise.add_filler:
        words.insert(rng.randrange(1, len(words) + 1), rng.choice(fillers))
    if rng.random() < noise.opener:
        words.insert(0, fillers[0])
    if rng.random() < noise.ramble:
        words += rng.choices(post.words, k=rng.choice((1, 2, 3)))
    return render(words)


def ideal_summary(post: Post) -> str:
    return render(post.items)


@functools.lru_cache(maxsize=8)  # a recipe's setup asks for the same 8192-row split several times (1-2 s each)
def make_split(num_rows: int, seed: int, split: str, conversational: bool = False) -> Dataset:
    """One split: `prompt`, `completion` (an SFT demonstration), `reference` (a human reference summary)."""
    return split_rows(num_rows, f"{NAME}-{seed}-{split}", conversational, sample_post,
                      lambda post, rng: noisy_summary(post, DEMONSTRATION_NOISE, rng),
                      lambda post, rng: noisy_summary(post, REFERENCE_NOISE, rng))


def make_splits(seed: int = 0, conversational: bool = False, sizes: dict[str, int] | None = None) -> DatasetDict:
    """Train / validation / test splits (sizes as `DEFAULT_SIZES` unless overridden); same seed, same rows."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    return DatasetDict({split: make_split(n, seed, split, conversational) for split, n in sizes.items()})


def score(post_words: list[str], completion: str, truncated: bool = False) -> float:
    """Gold score of one completion for a post given as its words. See `gold_reward`."""
    counts = Counter(post_words)
    items = [w for w in post_words if w in CONTENT_WORDS]
    text = completion.strip()
    ends_clean = text.endswith(".") and text.count(".") == 1 and not truncated
    words = text.replace(".", " ").replace(",", " ").split()
    covered: list[str] = []
    penalty = 0.0
    for w in words:
        if w in items and w not in covered:
            covered.append(w)
        elif w in items:
            penalty += 0.2  # repeated item
        elif w in counts:
            penalty += 0.3  # filler copied from the post
        else:
            penalty += 0.5  # not in the post at all
    recall = len(covered) / max(1, len(items))
    return 2 * recall + 0.3 * ends_clean - penalty - 0.005 * len(words)


def gold_reward(prompts: list, completions: list, truncated: list[bool] | None = None, **kwargs) -> list[float]:
    """The long-tail task's gold reward, with TRL's reward-function signature (texts or chat messages). Per
    completion:

        2 x the fraction of the post's items it lists                        (0 .. 2)
      + 0.3 if the text ends with its only period (it stopped: EOS right after the list)
      - 0.2 per repeated item, 0.3 per filler, 0.5 per word not in the post
      - 0.005 per word

    The ideal summary scores 2.3 less 0.005 per item, in any order; `truncated[i]` marks completions cut at the
    token limit.
    """
    truncated = truncated if truncated is not None else [False] * len(completions)
    return [score(post_words(_text(p)), _text(c), bool(t)) for p, c, t in zip(prompts, completions, truncated,
                                                                                 strict=True)]


def post_words(prompt: str) -> list[str]:
    """The words of the post in a prompt, without the list's commas."""
    return [w.rstrip(",") for w in _post_words(prompt)]
