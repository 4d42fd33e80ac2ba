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

import pytest

from async_rlhf.data import guess_task as g
from async_rlhf.data.tool_episodes import TurnTokens, resolve_call
from async_rlhf.generation.engine.episodes import EpisodeRunner, EpisodeSpec
from async_rlhf.types import Completion, GenerationRequest, SamplingSettings


@functools.cache
def tokenizer():
    return g.build_tokenizer()


class SameTurn:
    """A backend whose every sample is one assistant turn calling `tool(**arguments)` (or each (tool, arguments) of
    `calls`, in order), log-prob -0.25 a token."""

    def __init__(self, tool: str = "", arguments: dict | None = None, calls: list[tuple[str, dict]] = ()):
        calls = list(calls) or [(tool, arguments)]
        message = {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}
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


class OrderEnv:
    """Records when each of its calls ran: `note` (synchronous) and `later` (async), each `seconds` long."""

    def reset(self, **row):
        self.log = []

    def note(self, seconds: float) -> str:
        """Note a call.

        Args:
            seconds: how long it takes
        """
        start = time.monotonic()
        time.sleep(seconds)
        self.log.append(("note", start, time.monotonic()))
        return f"note {len(self.log)}"

    async def later(self, seconds: float) -> str:
        """Note a call, asynchronously.

        Args:
            seconds: how long it takes
        """
        start = time.monotonic()
        await asyncio.sleep(seconds)
        self.log.append(("later", start, time.monotonic()))
        return f"later {len(self.log)}"


class StrictEnv(SlowEnv):
    """A `reset` with named parameters only, as a user writes one for a routed dataset."""

    def reset(self, prompt, secret, seed):
        self.calls = 0
        return [{"type": "text", "text": f" (secret {secret})"}]  # content blocks, as a multimodal env returns


def request(rows: int, n: int = 2, **columns) -> GenerationRequest:
    data = [{**row, "secret": i, **columns} for i, row in enumerate(g.make_split(rows, 0, "test"))]
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


def test_a_turns_calls_keep_trls_order_one_after_another_then_the_async_ones():
    """TRL's `_tool_call_loop`: synchronous calls in the order made, one after another (they share the environment),
    then the `async def` ones together; the answers in that order. Episodes still run theirs at once."""
    calls = [("later", {"seconds": 0.05}), ("note", {"seconds": 0.05}), ("note", {"seconds": 0.0})]
    r = runner(OrderEnv, SameTurn(calls=calls), max_tool_calling_iterations=1)
    _, groups = r.run(request(1, n=2))
    for c in groups[0]:
        answers = [m["content"] for m in c.episode["messages"] if m["role"] == "tool"]
        assert answers == ["note 1", "note 2", "later 3"]
        log = [tuple(entry) for entry in c.episode["state"]["log"]]
        assert [name for name, _, _ in log] == ["note", "note", "later"]
        assert log[1][1] >= log[0][2] and log[2][1] >= log[1][2]  # none started before the one before it ended
    r.close()


def test_a_timed_out_call_leaves_the_turns_later_calls_unrun():
    calls = [("wait", {"seconds": 3.0}), ("wait", {"seconds": 0.0})]
    r = runner(SlowEnv, SameTurn(calls=calls), tool_timeout=0.3, max_tool_calling_iterations=1)
    _, groups = r.run(request(1, n=1))
    e = groups[0][0].episode
    assert (e["tool_calls"], e["tool_failures"], e["tool_timeouts"]) == (2, 2, 1)
    assert "not run: an earlier call of this turn timed out" in e["messages"][2]["content"]
    r.close()


def test_a_tool_answer_that_fills_the_budget_exactly_ends_the_episode_without_sampling_nothing():
    """TRL keeps an answer that reaches `max_completion_length` exactly and cuts the next turn to nothing; a backend
    asked for 0 ids would refuse (vLLM's max_tokens >= 1), so no turn is sampled."""
    backend = SameTurn("wait", {"seconds": 0.0})
    answer = TurnTokens(tokenizer()).tool_suffix([{"role": "tool", "name": "wait", "content": "done"}])
    budget = len(backend.ids) + len(answer)
    _, groups = runner(SlowEnv, backend, max_completion_length=budget).run(request(1, n=2))
    for c in groups[0]:
        assert c.token_ids == backend.ids + answer and c.mask == [1] * len(backend.ids) + [0] * len(answer)
        assert (c.episode["turns"], c.episode["finish"], c.finish_reason) == (1, "length", "length")
    assert len(backend.prompts) == 2  # one turn each


def test_a_routed_reset_gets_the_row_without_its_environment_column_and_content_blocks_append():
    spec = EpisodeSpec(tokenizer=tokenizer(), environment_factories={"strict": StrictEnv, "slow": SlowEnv},
                       max_completion_length=256, max_tool_calling_iterations=0, tool_timeout=5.0)
    _, groups = EpisodeRunner(spec, SameTurn("wait", {"seconds": 0.0})).run(request(2, n=1, environment="strict"))
    for p, group in enumerate(groups):
        e = group[0].episode
        assert e["error"] == "" and e["env"] == "StrictEnv"
        assert e["prompt"][-1]["content"][-1] == {"type": "text", "text": f" (secret {p})"}


def wait_tool(seconds: float) -> str:
    return "done"


def test_arguments_that_are_not_a_mapping_are_answered_as_trl_answers_them():
    def call(function: dict):
        return resolve_call({"type": "function", "function": {"name": "wait", **function}}, {"wait": wait_tool})

    answer = call({"arguments": "3"})[3]
    assert answer == {"error": f"{__name__}.wait_tool() argument after ** must be a mapping, not str"}
    with pytest.raises(TypeError) as raised:
        wait_tool(**"3")
    assert str(raised.value) == answer["error"]  # Python's own text, which TRL answers
    assert call({})[3] == {"error": "'arguments'"}  # TRL's `function["arguments"]` KeyError, as text
    assert call({"arguments": {"seconds": 1}})[1:3] == (wait_tool, {"seconds": 1})


class EndOfTurn(SameTurn):
    """A policy whose generation config declares its own end-of-turn id: the backend stops there and says "stop",
    though the last id is not the tokenizer's EOS."""

    def generate(self, prompts, settings, budgets=None):
        return [[Completion(c.token_ids[:-1], c.logprobs[:-1], "stop")]
                for [c] in super().generate(prompts, settings, budgets)]


def test_an_episode_finished_as_its_backend_says_for_its_last_sampled_turn():
    """TRL counts every end-of-sequence id of the model's generation config, not only the tokenizer's: the episode's
    finish is the backend's for its last sampled turn."""
    backend = EndOfTurn("peek", {})
    _, groups = runner(SlowEnv, backend, max_tool_calling_iterations=0).run(request(1, n=1))
    c = groups[0][0]
    assert c.token_ids[-1] != tokenizer().eos_token_id and c.finish_reason == "stop"
