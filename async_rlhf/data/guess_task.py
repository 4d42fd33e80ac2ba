"""The guessing task: an offline multi-turn task whose environment's answers must be read across turns.

The policy finds a secret number from 0 to 15 by calling one tool, `guess(n)`, which answers `higher` (the secret
is higher than n), `lower` or `correct`; it has `MAX_GUESSES` = 5 guesses. Guessing at random without repeats finds
the secret within 5 guesses in 5 of 16 episodes (chance); binary search, which reads every answer, in all 16. An
episode, rendered with the task's chat template (`data/tool_tokenizer.py`):

    <|im_start|>user
    Find the secret number from 0 to 15 ... You have 5 guesses.<|im_end|>
    <|im_start|>assistant
    <tool_call>
    {"name": "guess", "arguments": {"n": 7}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    higher
    </tool_response><|im_end|>
    <|im_start|>assistant
    ...
    The number is 12.<|im_end|>

(the tool schema's system block comes first). The environments have TRL 1.16's `environment_factory` form: a class
made with no arguments; `reset(**row)` starts an episode from a dataset row (its `secret` and `seed` columns; it
returns None, nothing is appended to the prompt); every other public method is a tool, whose schema TRL builds from
the type hints and the docstring; `get_reward()` is 1 for a secret found within the budget, else 0. They are
module-level classes, so a factory pickles (generator processes, TRL's async trainer).

`UninformativeGuessEnv` is the control: a wrong guess answers `higher` or `lower` by a coin drawn from the row's
`seed` and the guess's index, never from the secret, so no policy can find the secret more often than chance (5/16
without repeats); a gain on `GuessEnv` that is absent on the control comes from reading the answers.

The demonstrations the SFT policy learns from (`tasks/build_guess.py`) are random *legal* episodes: each guess is
drawn uniformly from the numbers the answers so far have not ruled out (`random_legal_guess`), so the SFT policy
reads the answers but does not halve the range; RL has the rest to learn (binary search). Deterministic given the
seed; bump `TASK_VERSION` when the environment, the prompts or the demonstrations change (the cached tokenizer and
policy are keyed by it).
"""

from __future__ import annotations

import random

from datasets import Dataset, DatasetDict

from async_rlhf.data.tool_episodes import TurnTokens
from async_rlhf.data.tool_tokenizer import build_tool_tokenizer, template_renderer

TASK_VERSION = 1
NAME = "guess"  # cache directories: <cache root>/guess-v<TASK_VERSION>
LOW, HIGH = 0, 15
NUMBERS = tuple(range(LOW, HIGH + 1))
MAX_GUESSES = 5  # binary search needs at most 5 on 16 numbers
CHANCE = MAX_GUESSES / len(NUMBERS)  # success of random guessing without repeats: 5/16
HIGHER, LOWER, CORRECT, OVER = "higher", "lower", "correct", "game over"
PROMPT = (f"Find the secret number from {LOW} to {HIGH}. Call guess with a number: it answers higher if the secret "
          f"is higher, lower if it is lower, or correct. You have {MAX_GUESSES} guesses.")
DEFAULT_SIZES = {"train": 4096, "test": 256}


def found_message(n: int) -> str:
    return f"The number is {n}."


OUT_OF_GUESSES = "I ran out of guesses."


class GuessEnv:
    """One episode of the guessing game (TRL `environment_factory` form). State: `secret`, `guesses` (the numbers
    guessed, in order, at most `MAX_GUESSES`), `answers`, `solved`."""

    def __init__(self):
        self.secret: int | None = None
        self.seed = 0
        self.guesses: list[int] = []
        self.answers: list[str] = []
        self.solved = False

    def reset(self, secret: int, seed: int = 0, **row) -> str | None:
        self.secret, self.seed = int(secret), int(seed)
        self.guesses, self.answers, self.solved = [], [], False
        return None

    def guess(self, n: int) -> str:
        """Guess the secret number.

        Args:
            n: The number guessed, from 0 to 15.

        Returns:
            higher if the secret is higher than n, lower if it is lower, correct if it is n.
        """
        if self.secret is None:
            raise RuntimeError("guess before reset")
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an integer, got {n!r}")
        if self.solved or len(self.guesses) >= MAX_GUESSES:
            return OVER
        self.guesses.append(n)
        if n == self.secret:
            self.solved = True
            answer = CORRECT
        else:
            answer = self._wrong_answer(n)
        self.answers.append(answer)
        return answer

    def get_reward(self) -> float:
        return 1.0 if self.solved else 0.0

    def _wrong_answer(self, n: int) -> str:
        return HIGHER if self.secret > n else LOWER


class UninformativeGuessEnv(GuessEnv):
    """The control: a wrong guess is answered `higher` or `lower` by a coin that depends only on the row's `seed` and
    how many guesses came before, never on the secret or the guess."""

    def _wrong_answer(self, n: int) -> str:
        return random.Random(f"guess-control-{self.seed}-{len(self.guesses)}").choice((HIGHER, LOWER))


ENVIRONMENTS = {"guess": GuessEnv, "control": UninformativeGuessEnv}


def make_split(num_rows: int, seed: int, split: str) -> Dataset:
    """One split: `prompt` (a conversation of one user message), `secret`, `seed` (the episode's own, for the control's
    coin). The train split draws secrets uniformly; any other split is balanced (each secret equally often, up to
    the remainder of `num_rows / 16`, in shuffled order), so a held-out success rate compares with chance exactly."""
    rng = random.Random(f"guess-{seed}-{split}")
    if split == "train":
        secrets = [rng.choice(NUMBERS) for _ in range(num_rows)]
    else:
        secrets = [NUMBERS[i % len(NUMBERS)] for i in range(num_rows)]
        rng.shuffle(secrets)
    return Dataset.from_dict({
        "prompt": [[{"role": "user", "content": PROMPT}] for _ in secrets],
        "secret": secrets,
        "seed": [rng.getrandbits(31) for _ in secrets],
    })


def make_splits(seed: int = 0, sizes: dict[str, int] | None = None) -> DatasetDict:
    """Train and held-out (`test`) splits; a split's rows depend only on `seed` and its name."""
    sizes = {**DEFAULT_SIZES, **(sizes or {})}
    return DatasetDict({split: make_split(n, seed, split) for split, n in sizes.items()})


# Policies as functions of the answers so far, [(guess, answer), ...] -> the next guess (demonstrations and tests).

def unruled(history: list[tuple[int, str]]) -> list[int]:
    """The numbers the answers so far allow, not yet guessed."""
    low, high = LOW, HIGH
    for g, a in history:
        if a == HIGHER:
            low = max(low, g + 1)
        elif a == LOWER:
            high = min(high, g - 1)
    guessed = {g for g, _ in history}
    return [n for n in range(low, high + 1) if n not in guessed]


def random_guess_without_repeats(history: list[tuple[int, str]], rng: random.Random) -> int:
    guessed = {g for g, _ in history}
    return rng.choice([n for n in NUMBERS if n not in guessed])


def random_legal_guess(history: list[tuple[int, str]], rng: random.Random) -> int:
    """A number the answers have not ruled out (the demonstrations' policy); any unguessed one when answers
    contradict each other (the control's)."""
    return rng.choice(unruled(history) or [n for n in NUMBERS if n not in {g for g, _ in history}])


def binary_search_guess(history: list[tuple[int, str]], rng: random.Random | None = None) -> int:
    allowed = unruled(history)
    return allowed[(len(allowed) - 1) // 2] if allowed else random_guess_without_repeats(history, rng or random.Random())


def play(env: GuessEnv, row: dict, policy, rng: random.Random) -> GuessEnv:
    """Play one episode of `env` from `row` with `policy` straight through the tool (no tokens)."""
    env.reset(**row)
    history: list[tuple[int, str]] = []
    while len(history) < MAX_GUESSES and not env.solved:
        g = policy(history, rng)
        history.append((g, env.guess(g)))
    return env


def next_message(env: GuessEnv, policy, rng: random.Random) -> dict:
    """What a demonstrator says next in `env`'s episode: a `guess` call chosen by `policy`, or, once the secret is
    found or the guesses are spent, a closing message without a call (which ends the episode)."""
    if env.solved:
        return {"role": "assistant", "content": found_message(env.guesses[-1])}
    if len(env.guesses) >= MAX_GUESSES:
        return {"role": "assistant", "content": OUT_OF_GUESSES}
    n = policy(list(zip(env.guesses, env.answers)), rng)
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}]}


def scripted_sampler(turn_tokens: TurnTokens, policy, rng: random.Random):
    """`run_episodes`' `sample` for a demonstrator: each turn's ids are those the chat template gives its message
    (log-probs 0)."""

    def sample(episodes, budgets):
        ids = [turn_tokens.assistant(next_message(e.env, policy, rng)) for e in episodes]
        return [(i, [0.0] * len(i)) for i in ids]

    return sample


def tokenizer_corpus() -> list[str]:
    """The texts the tokenizer's merges are learned from: for every number, turns that guess it with each answer, and
    the closing messages, rendered with the chat template and the tool schema. Fixed (not seeded)."""
    renderer = template_renderer()
    env = GuessEnv()
    texts = []
    for n in NUMBERS:
        messages = [{"role": "user", "content": PROMPT}]
        for answer in (HIGHER, LOWER, CORRECT, OVER):
            messages.append({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "guess", "arguments": {"n": n}}}]})
            messages.append({"role": "tool", "name": "guess", "content": answer})
        messages += [{"role": "assistant", "content": found_message(n)},
                     {"role": "assistant", "content": OUT_OF_GUESSES}]
        texts.append(renderer.apply_chat_template(messages, tools=[env.guess], tokenize=False))
    return texts * 4


def build_tokenizer(model_max_length: int = 1024):
    """The task's tokenizer (`data/tool_tokenizer.py`), merges learned from `tokenizer_corpus()`."""
    return build_tool_tokenizer(tokenizer_corpus(), model_max_length)
