"""Episodes inside a generator (`generation/engine/episodes.py`): a request with rows becomes n episodes per prompt,
token in, token out, with masks and log-probs per token; tool calls run concurrently within `tool_timeout`; an
environment that raises in `reset` or `get_reward` leaves its episode unscorable, never the others or the generator.

The policy here is a backend that always says the same turn (a call of `tool`, with `arguments`): what is tested is
the runner around it. Real sampling runs in tests/integration/test_multi_turn_run.py."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time

from async_rlhf.data import guess_task as g
from async_rlhf.data.tool_episodes import TurnTokens
from async_rlhf.generation.engine.episodes import EpisodeRunner, EpisodeSpec
from async_rlhf.types import Completion, GenerationRequest, SamplingSettings


@functools.cache
def tokenizer():
    return g.build_tokenizer()


class SameTurn:
    """A backend whose every sample is one assistant turn calling `tool(**arguments)`, log-prob -0.25 a token."""

    def __init__(self, tool: str, arguments: dict):
        message = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": tool, "arguments": arguments}}]}
        self.ids = TurnTokens(tokenizer()).assistant(message)
        self.prompts: list[list[int]] = []

    def generate(self, prompts, settings, budgets=None):
        assert settings.n == 1
        self.prompts += prompts
        return [[Completion(self.ids[:b], [-0.25] * len(self.ids[:b]), "stop")] for b in budgets]


class SlowEnv:
    def __init__(self):
        self.calls = 0

    def reset(self, **row):
        self.calls = 0

    def wait(self, seconds: float) -> str:
        """Wait a while.

        Args:
            seconds: how long
        """
        self.calls += 1
        time.sleep(seconds)
        return "done"

    def get_reward(self) -> float:
        return float(self.calls)


class AsyncEnv(SlowEnv):
    async def wait(self, seconds: float) -> str:
        """Wait a while.

        Args:
            seconds: how long
        """
        self.calls += 1
        await asyncio.sleep(seconds)
        return "done"


class BadResetEnv(SlowEnv):
    def reset(self, **row):
        if row["secret"] == 1:
            raise RuntimeError("no sandbox for secret 1")


class BadRewardEnv(SlowEnv):
    def get_reward(self) -> float:
        raise RuntimeError("judge unreachable")


def request(rows: int, n: int = 2) -> GenerationRequest:
    data = [{**row, "secret": i} for i, row in enumerate(g.make_split(rows, 0, "test"))]
    return GenerationRequest(batch_id=0, prompt_ids=list(range(rows)), prompt_token_ids=[[1]] * rows,
                             settings=SamplingSettings(max_new_tokens=256, n=n, seed=3), rows=data)


def runner(factory, backend, **fields) -> EpisodeRunner:
    spec = EpisodeSpec(tokenizer=tokenizer(), environment_factories={None: factory},
                       **{"max_completion_length": 256, "max_tool_calling_iterations": 2, "tool_timeout": 5.0,
                          **fields})
    return EpisodeRunner(spec, backend)


def test_episodes_are_token_in_token_out_with_masks_log_probs_and_rewards():
    backend = SameTurn("wait", {"seconds": 0.0})
    prompts, groups = runner(SlowEnv, backend).run(request(2, n=3))
    turns = TurnTokens(tokenizer())
    answer = turns.tool_suffix([{"role": "tool", "name": "wait", "content": "done"}])
    assert [len(g) for g in groups] == [3, 3] and len(prompts) == 2
    for prompt, group in zip(prompts, groups):
        for c in group:
            assert c.prompt_token_ids == []  # reset added nothing: the group's prompt
            # three turns (two rounds of calls, then the limit): sampled, answer, sampled, answer, sampled
            assert c.token_ids == backend.ids + answer + backend.ids + answer + backend.ids
            assert c.mask == [1] * len(backend.ids) + [0] * len(answer) + [1] * len(backend.ids) + [0] * len(
                answer) + [1] * len(backend.ids)
            assert [lp for lp, m in zip(c.logprobs, c.mask) if m] == [-0.25] * sum(c.mask)
            assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask) if not m)
            e = c.episode
            assert (e["turns"], e["tool_calls"], e["tool_failures"], e["finish"], e["error"]) == (3, 2, 0,
                                                                                                "iterations", "")
            assert e["rewards"] == {"SlowEnv": 2.0} and e["state"] == {"calls": 2} and e["env"] == "SlowEnv"
            assert [m["role"] for m in e["messages"]] == ["assistant", "tool", "assistant", "tool", "assistant"]
            assert Completion.from_dict(dataclasses.asdict(c)) == c  # crosses processes and checkpoints
    # each turn's prompt as sent: the first prompt, then exactly what came before
    first = prompts[0]
    assert backend.prompts[0] == first and backend.prompts[6] == first + backend.ids + answer


def test_weights_loaded_between_turns_are_recorded_per_token():
    """`between_turns` (the serve loop's in-flight loads) runs before each turn after the first; an episode whose turns
    were sampled by several versions records each version from its turn's first sampled token; one version: none."""
    backend = SameTurn("wait", {"seconds": 0.0})
    loaded = iter([7, 8])  # after turn 1: version 7 loaded; after turn 2: 8
    turns = TurnTokens(tokenizer())
    answer = turns.tool_suffix([{"role": "tool", "name": "wait", "content": "done"}])
    _, groups = runner(SlowEnv, backend).run(request(1, n=2), 6, between_turns=lambda: next(loaded))
    turn = len(backend.ids) + len(answer)  # one sampled turn and its answer
    for c in groups[0]:
        assert c.version_starts == [[6, 0], [7, turn], [8, 2 * turn]]
        assert Completion.from_dict(dataclasses.asdict(c)) == c
    _, groups = runner(SlowEnv, backend).run(request(1, n=2), 6, between_turns=lambda: 6)  # nothing new arrived
    assert all(c.version_starts == [] for c in groups[0])


def test_a_slow_tool_call_answers_a_timeout_holds_only_its_own_answer_and_its_environment_is_not_reused():
    backend = SameTurn("wait", {"seconds": 3.0})
    r = runner(SlowEnv, backend, tool_timeout=0.3, max_tool_calling_iterations=1)
    t0 = time.monotonic()
    _, groups = r.run(request(2, n=2))
    assert time.monotonic() - t0 < 2.5  # four calls at once, each cut at 0.3 s (not 4 x 3 s)
    for c in (c for g in groups for c in g):
        assert (c.episode["tool_calls"], c.episode["tool_failures"], c.episode["tool_timeouts"]) == (1, 1, 1)
        assert "timed out after 0.3 s" in c.episode["messages"][1]["content"]
    assert r.free[None] == []  # their calls may still run: none goes back to the pool
    r.close()


def test_async_tools_run_on_the_event_loop_within_the_limit():
    r = runner(AsyncEnv, SameTurn("wait", {"seconds": 0.05}), max_tool_calling_iterations=1)
    _, groups = r.run(request(1, n=4))
    assert all(c.episode["tool_calls"] == 1 and c.episode["tool_failures"] == 0 for c in groups[0])
    assert len(r.free[None]) == 4  # reset and reused next time, not made again
    r.run(request(1, n=4))
    assert len(r.free[None]) == 4
    r.close()


def test_an_environment_that_raises_leaves_only_its_episode_unscorable():
    _, groups = runner(BadResetEnv, SameTurn("wait", {"seconds": 0.0}), max_tool_calling_iterations=0).run(request(3))
    errors = [[c.episode["error"] for c in g] for g in groups]
    assert errors[1] == ["reset raised RuntimeError: no sandbox for secret 1"] * 2
    assert errors[0] == errors[2] == ["", ""]
    assert all(c.token_ids == [] for c in groups[1]) and all(c.token_ids for c in groups[0])
    _, groups = runner(BadRewardEnv, SameTurn("wait", {"seconds": 0.0}), max_tool_calling_iterations=0).run(request(1))
    assert all(c.episode["error"] == "get_reward raised RuntimeError: judge unreachable" for c in groups[0])


def test_unknown_tools_and_bad_arguments_are_answered_and_counted():
    _, groups = runner(SlowEnv, SameTurn("peek", {}), max_tool_calling_iterations=1).run(request(1, n=1))
    e = groups[0][0].episode
    assert (e["tool_calls"], e["tool_failures"]) == (1, 1) and "Tool peek not found." in e["messages"][1]["content"]
    _, groups = runner(SlowEnv, SameTurn("wait", {"minutes": 1}), max_tool_calling_iterations=1).run(request(1, n=1))
    assert groups[0][0].episode["tool_failures"] == 1 and "minutes" in groups[0][0].episode["messages"][1]["content"]
