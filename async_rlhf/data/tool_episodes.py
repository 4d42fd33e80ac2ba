"""Multi-turn tool episodes built token in, token out, as TRL 1.16's `GRPOTrainer._tool_call_loop` builds them.

Guarantee: turn n+1's prompt ids are exactly turn n's prompt ids, then the ids sampled in turn n, then the tool
answers' ids rendered alone (`TurnTokens.tool_suffix`, TRL's `_get_tool_suffix_ids`); what was sampled is never
decoded and encoded again. Sampled ids carry mask 1 and their behaviour log-prob, tool-answer ids mask 0 and 0.0.
Decoding happens only to *read* a turn: `trl.chat_template_utils.parse_response` finds its tool calls.

The rest follows TRL's loop: `reset(**row)`'s returned string is appended to the last user message; the prompt is
rendered with the environment's tools; each tool call runs (a tool that raises, or an unknown name, answers
`{"error": ...}` and is counted as a failure); at most `max_tool_calling_iterations` rounds of calls; the episode
budget `max_completion_length` counts every id after the first prompt, and a tool answer that would overflow it is
rolled back and ends the episode (one that fills it exactly ends it too: nothing is left to sample). Episodes run side
by side: each round samples every episode still going in one call of `sample`, then runs the round's tool calls
through `call_tools`. Within one episode's turn the calls run as TRL runs them: the synchronous ones one after another
in the order called, then the `async def` ones together, their answers in that order (default `call_in_turn`: every
episode in turn, in this thread; the generator runs the episodes concurrently with a time limit a call,
`generation/engine/episodes.py`). An environment whose `reset` raises leaves its episode unscorable
(`Episode.error`), never the others.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trl.chat_template_utils import parse_response


def environment_tools(env) -> list[Callable]:
    """The environment's tools as TRL takes them: every public function of its class but `reset` and `get_reward`,
    bound to `env` (listed on the class: properties are not evaluated)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in ("reset", "get_reward") and not name.startswith("_")]


class TurnTokens:
    """The ids the chat template gives each piece of an episode, cached by content (episodes repeat them)."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.kwargs = chat_template_kwargs or {}
        self._cache: dict[str, list[int]] = {}

    def _render(self, messages: list[dict], generation_prompt: bool, tools=None) -> list[int]:
        return list(self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=True,
                                                       add_generation_prompt=generation_prompt, return_dict=False,
                                                       **self.kwargs))

    def prompt(self, messages: list[dict], tools: list[Callable]) -> list[int]:
        """The first prompt: the conversation and the tools' schema, then the assistant header."""
        key = json.dumps(["prompt", messages, [f"{t.__module__}.{t.__qualname__}" for t in tools]])  # two classes'
        # tools of one name have two schemas
        if key not in self._cache:
            self._cache[key] = self._render(messages, True, tools)
        return self._cache[key]

    def tool_suffix(self, tool_messages: list[dict]) -> list[int]:
        """The tool answers rendered alone, up to the next assistant header: TRL's `_get_tool_suffix_ids` (a dummy
        call of the first answer's tool, rendered with and without the answers; the prefix cut after its last EOS)."""
        key = json.dumps(["tool", tool_messages])
        if key not in self._cache:
            calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
            dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
            prefix = self._render(dummy, False)
            full = self._render(dummy + tool_messages, True)
            eos = [i for i, t in enumerate(prefix) if t == self.tokenizer.eos_token_id]
            if eos:
                prefix = prefix[:eos[-1] + 1]
            if full[:len(prefix)] != prefix:
                raise ValueError("the chat template is not prefix-preserving: the EOS-trimmed prefix ids are not a "
                                 "prefix of the ids with the tool answers")
            self._cache[key] = full[len(prefix):]
        return self._cache[key]

    def assistant(self, message: dict) -> list[int]:
        """The ids a policy samples to say `message` after the assistant header, through its EOS (demonstrations)."""
        key = json.dumps(["assistant", message])
        if key not in self._cache:
            user = [{"role": "user", "content": "dummy"}]
            prefix = self._render(user, True)
            full = self._render(user + [message], False)
            if full[:len(prefix)] != prefix:
                raise ValueError("the chat template renders the assistant header differently inside a conversation")
            ids = full[len(prefix):]
            self._cache[key] = ids[:ids.index(self.tokenizer.eos_token_id) + 1]
        return self._cache[key]


@dataclass
class Episode:
    """One episode as it was run."""

    row: dict
    env: Any
    tools: list[Callable]
    prompt_ids: list[int]  # [P] the first turn's prompt
    prompt: list[dict] = field(default_factory=list)  # its messages: the row's, `reset`'s observation appended
    completion_ids: list[int] = field(default_factory=list)  # [C] every id after the prompt: sampled and tool ids
    mask: list[int] = field(default_factory=list)  # [C] 1: sampled by the policy; 0: a tool's answer
    logprobs: list[float] = field(default_factory=list)  # [C] behaviour log-prob of each sampled id; 0.0 for tool ids
    turn_prompts: list[list[int]] = field(default_factory=list)  # [turns][P_t] each turn's prompt, as sent
    messages: list[dict] = field(default_factory=list)  # the assistant turns as parsed and the tool answers
    tool_calls: int = 0
    tool_failures: int = 0
    tool_timeouts: int = 0  # calls past the time limit (counted in `tool_failures` too)
    finish: str = ""  # "answered" (a turn without tool calls), "iterations", "length" (the budget), "error"
    error: str = ""  # why it cannot be scored (its environment's `reset` raised); "" if it can

    @property
    def turns(self) -> int:
        return len(self.turn_prompts)


Sample = Callable[[list[Episode], list[int]], list[tuple[list[int], list[float]]]]


TIMED_OUT = "timed out"  # the `failed` value of a call past its time limit


Answer = tuple[str, Any, "bool | str"]  # (tool name, result or {"error": ...}, failed: True, TIMED_OUT or False)
TurnCalls = tuple[list[dict], dict[str, Callable]]  # one episode's parsed tool calls of a turn, its tools by name


def resolve_call(tool_call: dict, tools: dict[str, Callable]) -> tuple[str, Callable | None, dict, Any]:
    """(name, function, arguments, error answer) of one parsed call: the function is None when the call cannot run
    (TRL's answers: an unsupported call type, an unknown tool, arguments that `**` cannot take)."""
    if tool_call.get("type") != "function":
        name = tool_call.get("name", "unknown")
        return name, None, {}, {"error": f"Unsupported tool call type: {tool_call.get('type')}"}
    function = tool_call["function"]
    name = function["name"]
    if name not in tools:
        return name, None, {}, {"error": f"Tool {name} not found."}
    if "arguments" not in function:  # TRL's `function["arguments"]` raises KeyError: its text is the answer
        return name, None, {}, {"error": "'arguments'"}
    arguments = function["arguments"]
    if not isinstance(arguments, Mapping):  # TRL's `tool(**arguments)` raises TypeError: the answer is its text
        return name, None, {}, {"error": f"{_function_str(tools[name])} argument after ** must be a mapping, "
                                         f"not {type(arguments).__name__}"}
    return name, tools[name], dict(arguments), None


def _function_str(func: Callable) -> str:
    """How Python names a function in a call's TypeError (CPython's `_PyObject_FunctionStr`)."""
    qualname = getattr(func, "__qualname__", None)
    if qualname is None:
        return str(func)
    module = getattr(func, "__module__", None)
    return f"{module}.{qualname}()" if module not in (None, "builtins") else f"{qualname}()"


NOT_RUN = "tool {!r} not run: an earlier call of this turn timed out"


async def turn_in_order(calls: list[dict], tools: dict[str, Callable], run_sync, settle) -> list[Answer]:
    """One episode's calls of a turn, answered in TRL's order (the module docstring): `await run_sync(name, function,
    arguments)` answers a synchronous call, `await settle(name, coroutine)` an `async def` one. After a call timed out
    (`TIMED_OUT`), the turn's later calls are answered without running: its environment may still be busy."""
    answers, pending, timed_out = [], [], False
    for tool_call in calls:
        name, func, arguments, error = resolve_call(tool_call, tools)
        if func is None:
            answers.append((name, error, True))
        elif timed_out:
            answers.append((name, {"error": NOT_RUN.format(name)}, True))
        elif inspect.iscoroutinefunction(func):
            try:
                pending.append((name, func(**arguments)))
            except Exception as e:  # bad arguments: raised when the coroutine is made, answered in order (TRL)
                answers.append((name, {"error": str(e)}, True))
        else:
            answers.append(await run_sync(name, func, arguments))
            timed_out = answers[-1][2] == TIMED_OUT
    if timed_out:
        for name, coro in pending:
            coro.close()
            answers.append((name, {"error": NOT_RUN.format(name)}, True))
        return answers
    return answers + list(await asyncio.gather(*(settle(name, coro) for name, coro in pending)))


def call_in_turn(turns: list[TurnCalls]) -> list[list[Answer]]:
    """`run_episodes`' default `call_tools`: in this thread, with no time limit, on one event loop a round (each
    synchronous call runs to its end before the next; the `async def` ones of different episodes interleave)."""
    async def round_():
        return await asyncio.gather(*(turn_in_order(calls, tools, _run_here, _awaited) for calls, tools in turns))

    return list(asyncio.run(round_())) if turns else []


async def _run_here(name: str, func: Callable, arguments: dict) -> Answer:
    try:
        return name, func(**arguments), False
    except Exception as e:  # the model's mistake (or the tool's), answered to the model
        return name, {"error": str(e)}, True


async def _awaited(name: str, coro) -> Answer:
    try:
        return name, await coro, False
    except Exception as e:
        return name, {"error": str(e)}, True


def start_episode(row: dict, env, tools: list[Callable], turn_tokens: TurnTokens,
                  multi_environment: bool = False) -> Episode:
    """An episode from its dataset row: `env.reset(**row)` (None: tools only; with several environments the row's
    `environment` column, which routes it, is not passed), whose returned observation is appended to the last user
    message (text or content blocks, as TRL appends it), and the first prompt rendered with the standalone `tools`
    and the environment's."""
    prompt = [dict(m) for m in row["prompt"]]
    all_tools = list(tools)
    try:
        if env is not None:
            observation = env.reset(**({k: v for k, v in row.items() if k != "environment"}
                                       if multi_environment else row))
            if observation is not None:
                content = prompt[-1]["content"]
                if isinstance(observation, list) and isinstance(content, str):
                    content = [{"type": "text", "text": content}]
                if isinstance(observation, str) and isinstance(content, list):
                    observation = [{"type": "text", "text": observation}]
                prompt[-1]["content"] = content + observation
            all_tools += environment_tools(env)
    except Exception as e:  # the environment's fault: this episode cannot be scored, the others go on
        return Episode(row=row, env=env, tools=all_tools, prompt_ids=[], prompt=prompt, finish="error",
                       error=f"reset raised {type(e).__name__}: {e}")
    return Episode(row=row, env=env, tools=all_tools, prompt_ids=turn_tokens.prompt(prompt, all_tools),
                   prompt=prompt)


def run_episodes(tokenizer, envs: list, rows: list[dict], sample: Sample, max_completion_length: int,
                 max_tool_calling_iterations: int, turn_tokens: TurnTokens | None = None,
                 max_model_len: int | None = None, tools: list[Callable] = (), call_tools=call_in_turn,
                 multi_environment: bool = False) -> list[Episode]:
    """Run one episode per (env, row) to its end (env None: the standalone `tools` only). `sample(episodes,
    budgets)` returns, for each episode, the ids sampled after `episode.turn_prompts[-1]` (at most `budgets[i]` of
    them, each at least 1) and their log-probs. `call_tools(turns)` runs a round's calls, one `TurnCalls` an episode
    calling, and returns each episode's answers (name, result, failed), one a call, in TRL's order: `failed` True
    for an error, `TIMED_OUT` for a call past its time limit."""
    turn_tokens = turn_tokens or TurnTokens(tokenizer)
    episodes = [start_episode(row, env, tools, turn_tokens, multi_environment)
                for env, row in zip(envs, rows, strict=True)]
    active = [e for e in episodes if not e.error]
    iteration = 0
    while active:
        for e in active:
            if len(e.completion_ids) >= max_completion_length:  # a tool answer filled the budget: TRL's next turn
                e.finish = "length"  # is cut to nothing, so none is sampled
        active = [e for e in active if e.finish != "length"]
        if not active:
            break
        budgets = [max_completion_length - len(e.completion_ids) for e in active]
        for e in active:
            e.turn_prompts.append(e.prompt_ids + e.completion_ids)
        calling = []
        for e, budget, (ids, logprobs) in zip(active, budgets, sample(active, budgets), strict=True):
            ids, logprobs = list(ids[:budget]), list(logprobs[:budget])
            e.completion_ids += ids
            e.mask += [1] * len(ids)
            e.logprobs += logprobs
            message = parse_response(tokenizer, ids, prefix=e.turn_prompts[-1], tools=e.tools) if ids else {}
            if message:
                e.messages.append(message)
            if not message.get("tool_calls"):
                e.finish = "answered"
            elif iteration >= max_tool_calling_iterations:
                e.finish = "iterations"
            else:
                calling.append(e)
        active = []
        turns = [(e.messages[-1]["tool_calls"], {t.__name__: t for t in e.tools}) for e in calling]
        for e, results in zip(calling, call_tools(turns), strict=True):
            answers = []
            for name, result, failed in results:
                e.tool_calls += 1
                e.tool_failures += bool(failed)
                e.tool_timeouts += failed == TIMED_OUT
                answers.append({"role": "tool", "name": name, "content": result if isinstance(result, list)
                                else str(result)})
            suffix = turn_tokens.tool_suffix(answers)
            total = len(e.prompt_ids) + len(e.completion_ids) + len(suffix)
            if total - len(e.prompt_ids) > max_completion_length or (max_model_len and total >= max_model_len):
                e.finish = "length"  # TRL rolls the answers back: the episode ends on the call
                continue
            e.messages += answers
            e.completion_ids += suffix
            e.mask += [0] * len(suffix)
            e.logprobs += [0.0] * len(suffix)
            active.append(e)
        iteration += 1
    return episodes
