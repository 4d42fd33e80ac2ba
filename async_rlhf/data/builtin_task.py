"""The built-in task: a miniature of the paper's TL;DR summarisation setup that runs offline on a laptop CPU.

A prompt is a short Reddit-like "post" over a small vocabulary, written like the TL;DR prompts of the paper:

    SUBREDDIT: r/pets
    POST: my cat was sick so the vet saw my cat and the vet was kind
    TL;DR:

The post mentions a few *key* content words at least twice ("cat", "vet") among filler words ("my", "so") and
*distractor* content words said once ("kind"). A good summary lists the key words in the order the post first
mentions them and stops: `" cat vet."` followed by EOS.

Three roles of the paper map onto this task:
- the **gold reward** (`gold_reward`, the paper's 6.9B gold RM) is a program: it scores any completion with a
  continuous value that rewards covering the key words, brevity and ending cleanly, and penalises fillers,
  distractors, words not in the post, repeats and rambling past the end;
- the **human reference summaries** (`reference` column) come from a noisy oracle with no house style but
  careless content: right about one time in four, otherwise with an extra content word, two key words swapped or
  (rarely) a key word dropped, so a policy can beat them;
- the **SFT demonstrations** (`completion` column) come from an oracle that is careful about content but has a
  house style the gold reward dislikes (most open with a filler word, some ramble on), so the SFT policy starts
  below the references (the paper's Table 1: SFT wins about a third of the time) and RLHF has something to fix.

Posts, demonstrations and references draw from three separate random streams, so changing one oracle's noise
leaves the posts (and the other oracle's summaries) as they are.

Why "ending with EOS" is read from the text: TRL-style reward functions see decoded text with special tokens
removed. Summaries end with a period, so a completion that stops right after its period ended with EOS; one that
was cut at the token limit (or rambled on) does not end with the period. Callers that know which completions hit
the length limit can pass `truncated=[...]` to `gold_reward` to make that exact.

Everything is deterministic given `seed`: each split's posts draw from `random.Random(f"{seed}-{split}")`, its
demonstrations and references from streams of their own.
Bump `TASK_VERSION` whenever the vocabulary, the generator or the gold reward changes: cached SFT / reward
models (see `tasks/build_builtin.py`) are keyed by it.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from dataclasses import dataclass

from datasets import Dataset, DatasetDict

TASK_VERSION = 5
NAME = "builtin"  # cache directories: <cache root>/builtin-v<TASK_VERSION>

TOPICS: dict[str, tuple[str, ...]] = {
    "relationships": ("girlfriend", "boyfriend", "wife", "husband", "date", "wedding", "breakup", "parents",
                      "friend", "texts", "trust", "ring"),
    "pets": ("cat", "dog", "vet", "puppy", "kitten", "leash", "food", "walk", "toy", "bird", "fish", "cage"),
    "work": ("job", "boss", "office", "salary", "meeting", "email", "project", "coworker", "interview", "deadline",
             "promotion", "shift"),
    "money": ("rent", "loan", "bank", "debt", "savings", "budget", "credit", "bills", "taxes", "paycheck",
              "mortgage", "card"),
    "gaming": ("game", "console", "controller", "server", "team", "match", "level", "headset", "stream", "guild",
               "raid", "patch"),
    "cooking": ("pasta", "oven", "recipe", "garlic", "pan", "sauce", "bread", "soup", "knife", "kitchen", "rice",
                "butter"),
    "fitness": ("gym", "run", "weights", "diet", "protein", "coach", "knee", "squat", "marathon", "shoes",
                "stretch", "yoga"),
    "travel": ("flight", "hotel", "airport", "passport", "train", "beach", "luggage", "visa", "tour", "map",
               "island", "taxi"),
}
FILLERS: tuple[str, ...] = ("i", "my", "the", "a", "and", "so", "was", "is", "just", "really", "very", "then",
                            "but", "today", "about", "with", "it", "to", "got", "after", "now", "me", "we", "this")
CONTENT_WORDS: frozenset[str] = frozenset(w for words in TOPICS.values() for w in words)
VOCABULARY: tuple[str, ...] = tuple(sorted(CONTENT_WORDS)) + FILLERS

PROMPT_TEMPLATE = "SUBREDDIT: r/{topic}\nPOST: {post}\nTL;DR:"
DEFAULT_SIZES = {"train": 8192, "validation": 512, "test": 512}


@dataclass(frozen=True)
class OracleNoise:
    """How a noisy summariser deviates from the ideal summary. Probabilities are per summary unless noted."""

    drop_key: float  # each key word is left out with this probability (at least one key word is kept)
    add_filler: float  # one filler word from the post is inserted at a random place
    add_distractor: float  # one distractor (a content word the post says once) is inserted
    swap: float  # two neighbouring key words are swapped
    opener: float  # the summary starts with the post's first filler word ("my cat vet.")
    ramble: float  # one to three post words are appended after the key words


# Human references: no house style, careless content (like the Reddit TL;DRs the paper compares against): an extra
# content word or two swapped key words, flawed about three times in four, so a policy that writes the ideal
# summary wins about 86% against them (ties count half) and the SFT policy about a third of the time. Their flaws
# cost less than a filler word (0.2 for a distractor, 0.1 for the order), so a summary with an opener loses to them.
REFERENCE_NOISE = OracleNoise(drop_key=0.05, add_filler=0.0, add_distractor=0.45, swap=0.4, opener=0.0, ramble=0.0)
# SFT demonstrations: careful content with a house style the gold reward dislikes: most open with a filler word
# from the post ("my cat vet.") and some ramble on, so the SFT policy's greedy summary opens with one too. Like the
# paper's SFT policy, it writes plausible summaries that lose to the references about two times in three, and
# RLHF has a clear, learnable preference to find (drop the opener, keep the key words).
DEMONSTRATION_NOISE = OracleNoise(drop_key=0.02, add_filler=0.05, add_distractor=0.05, swap=0.03, opener=0.6,
                                  ramble=0.15)


@dataclass(frozen=True)
class Post:
    topic: str
    words: tuple[str, ...]

    @property
    def key_words(self) -> list[str]:
        """Content words said at least twice, in the order of their first mention."""
        counts = Counter(self.words)
        return [w for w in dict.fromkeys(self.words) if w in CONTENT_WORDS and counts[w] >= 2]

    @property
    def prompt(self) -> str:
        return PROMPT_TEMPLATE.format(topic=self.topic, post=" ".join(self.words))


def sample_post(rng: random.Random) -> Post:
    """2-3 on-topic key words said 2-3 times each, 1-2 distractors said once, fillers in between (8-25 words).

    Distractors are usually off-topic words (easy to tell apart by the subreddit); one time in three an
    on-topic word said once joins them, which only counting mentions tells apart from a key word."""
    topic = rng.choice(sorted(TOPICS))
    own = list(TOPICS[topic])
    rng.shuffle(own)
    num_keys = rng.choice((2, 3))
    keys = own[:num_keys]
    others = rng.sample([t for t in sorted(TOPICS) if t != topic], 2)
    distractors = [rng.choice(TOPICS[t]) for t in others[:rng.choice((1, 1, 2))]]
    if rng.random() < 1 / 3:
        distractors.append(own[num_keys])
    content = [w for w in keys for _ in range(rng.choice((2, 2, 3)))] + distractors
    rng.shuffle(content)
    words: list[str] = []
    for w in content:
        words += rng.choices(FILLERS, k=rng.choice((0, 1, 1)))
        words.append(w)
    return Post(topic, tuple(words))


def noisy_summary(post: Post, noise: OracleNoise, rng: random.Random) -> str:
    """The ideal summary (key words in first-mention order, then a period) with `noise` applied.

    Returns the completion text as the model writes it after "TL;DR:": a leading space, words, a period."""
    keys = post.key_words
    words = [w for w in keys if rng.random() >= noise.drop_key] or [rng.choice(keys)]
    if len(words) >= 2 and rng.random() < noise.swap:
        i = rng.randrange(len(words) - 1)
        words[i], words[i + 1] = words[i + 1], words[i]
    distractors = [w for w in dict.fromkeys(post.words) if w in CONTENT_WORDS and w not in keys]
    if distractors and rng.random() < noise.add_distractor:
        words.insert(rng.randrange(len(words) + 1), rng.choice(distractors))
    fillers = [w for w in dict.fromkeys(post.words) if w not in CONTENT_WORDS] or list(FILLERS)
    if rng.random() < noise.add_filler:
        words.insert(rng.randrange(1, len(words) + 1), rng.choice(fillers))
    if rng.random() < noise.opener:
        words.insert(0, fillers[0])
    if rng.random() < noise.ramble:
        words += rng.choices(post.words, k=rng.choice((1, 2, 3)))
    return " " + " ".join(words) + "."


def ideal_summary(post: Post) -> str:
    return " " + " ".join(post.key_words) + "."


@functools.lru_cache(maxsize=8)  # a recipe's setup asks for the same 8192-row split several times (1-2 s each)
def make_split(num_rows: int, seed: int, split: str, conversational: bool = False) -> Dataset:
    """One split: `prompt`, `completion` (an SFT demonstration) and `reference` (a human reference summary)."""
    return split_rows(num_rows, f"{seed}-{split}", conversational, sample_post,
                      lambda post, rng: noisy_summary(post, DEMONSTRATION_NOISE, rng),
                      lambda post, rng: noisy_summary(post, REFERENCE_NOISE, rng))


def split_rows(num_rows: int, rng_name: str, conversational: bool, sample, demonstrate, refer) -> Dataset:
    """`num_rows` rows of posts from `sample(rng)`, each with a demonstration `demonstrate(post, rng)` and a
    reference `refer(post, rng)`, every stream seeded by `rng_name` (shared by the built-in and long-tail tasks)."""
    rng = random.Random(rng_name)
    demonstration_rng = random.Random(f"{rng_name}-demonstration")
    reference_rng = random.Random(f"{rng_name}-reference")
    rows: dict[str, list] = {"prompt": [], "completion": [], "reference": []}
    for _ in range(num_rows):
        post = sample(rng)
        demonstration = demonstrate(post, demonstration_rng)
        reference = refer(post, reference_rng)
        if conversational:  # the chat template's tokenizer adds the leading space back (see data/tokenizer.py)
            rows["prompt"].append([{"role": "user", "content": post.prompt}])
            rows["completion"].append([{"role": "assistant", "content": demonstration.strip()}])
        else:
            rows["prompt"].append(post.prompt)
            rows["completion"].append(demonstration)
        rows["reference"].append(reference)
    return Dataset.from_dict(rows)


def make_splits(seed: int = 0, conversational: bool = False, sizes: dict[str, int] | None = None) -> DatasetDict:
    """Train / validation / test splits of the built-in task; the same `seed` always gives the same rows.

    `sizes` overrides the number of rows per split (default `DEFAULT_SIZES`); a split's rows do not depend on the
    other splits' sizes. Columns: `prompt` (text, or a one-message user conversation if `conversational`),
    `completion` (an SFT demonstration, text or one assistant message) and `reference` (always text)."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    return DatasetDict({split: make_split(n, seed, split, conversational) for split, n in sizes.items()})


# --------------------------------------------------------------------------------------------------------------
# Gold reward


def _text(x) -> str:
    """Plain text of a prompt or completion given as a string or as a list of chat messages."""
    if isinstance(x, str):
        return x
    if isinstance(x, dict):
        return str(x.get("content", ""))
    return "\n".join(str(m.get("content", "")) for m in x)


def _post_words(prompt: str) -> list[str]:
    body = prompt.split("POST:", 1)[-1].split("TL;DR:", 1)[0]
    return body.split()


def score(post_words: list[str], completion: str, truncated: bool = False) -> float:
    """Gold score of one completion for a post given as its words. See `gold_reward`."""
    counts = Counter(post_words)
    keys = [w for w in dict.fromkeys(post_words) if w in CONTENT_WORDS and counts[w] >= 2]
    text = completion.strip()
    ends_clean = text.endswith(".") and text.count(".") == 1 and not truncated
    words = text.replace(".", " ").split()

    covered: list[str] = []
    penalty = 0.0
    for w in words:
        if w in keys and w not in covered:
            covered.append(w)
        elif w in keys:
            penalty += 0.2  # repeated key word
        elif w in CONTENT_WORDS and w in counts:
            penalty += 0.2  # distractor: in the post, but said once
        elif w in counts:
            penalty += 0.3  # filler copied from the post
        else:
            penalty += 0.5  # not in the post at all
    recall = sum(counts[w] for w in covered) / max(1, sum(counts[w] for w in keys))
    in_order = sum(keys.index(a) < keys.index(b) for a, b in zip(covered, covered[1:]))
    order = 0.1 * in_order / (len(covered) - 1) if len(covered) >= 2 else 0.0
    return 2 * recall + order + 0.3 * ends_clean - penalty - 0.02 * len(words)


def gold_reward(prompts: list, completions: list, truncated: list[bool] | None = None, **kwargs) -> list[float]:
    """The programmatic gold reward, with TRL's reward-function signature.

    `prompts` / `completions` are texts or chat conversations (lists of `{"role", "content"}` messages); extra
    keyword arguments (dataset columns, `completion_ids`, ...) are ignored. Per completion:

        2 x recall of the key words, weighted by how often the post says each   (0 .. 2)
      + 0.1 x fraction of neighbouring key words in the post's order
      + 0.3 if the text ends with its only period (it stopped: EOS right after the summary)
      - 0.2 per repeated key word or distractor, 0.3 per filler, 0.5 per word not in the post
      - 0.02 per word (brevity)

    The ideal summary of a 3-key-word post scores about 2.34; rambling to the token limit scores below zero.
    `truncated[i]` (optional) marks completions cut at the token limit: they lose the clean-ending bonus.
    """
    truncated = truncated if truncated is not None else [False] * len(completions)
    return [
        score(_post_words(_text(p)), _text(c), bool(t)) for p, c, t in zip(prompts, completions, truncated, strict=True)
    ]
