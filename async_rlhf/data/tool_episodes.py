"""Multi-turn tool episodes built token in, token out, as TRL 1.16's `GRPOTrainer._tool_call_loop` builds them.

Guarantee: turn n+1's prompt ids are exactly turn n's prompt ids, then the ids sampled in turn n, then the tool
answers' ids rendered alone (`TurnTokens.tool_suffix`, TRL's `_get_tool_suffix_ids`); what was sampled is never
decoded and encoded again. Sampled ids carry mask 1 and their behaviour log-prob, tool-answer ids mask 0 and 0.0.
Decoding happens only to *read* a turn: `trl.chat_template_utils.parse_response` finds its tool calls.

The rest follows TRL's loop: `reset(**row)`'s returned string is appended to the last user message; the prompt is
rendered with the environment's tools; each tool call runs (a tool that raises, or an unknown name, answers
`{"error": ...}` and is counted as a failure); at most `max_tool_calling_iterations` rounds of calls; the episode
budget `max_completion_length` counts every id after the first prompt, and a tool answer that would overflow it is
rolled back and ends the episode. Episodes run side by side: each round samples every episode still going in one
call of `sample`, then runs the round's tool calls through `call_tools` (default: one after the other, in this
thread; the generator runs them concurrently with a time limit, `generation/engine/episodes.py`). An environment whose
`reset` raises leaves its episode unscorable (`Episode.error`), never the others.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
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
        key = json.dumps(["prompt", messages, [t.__name__ for t in tools]])
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


def resolve_call(tool_call: dict, tools: dict[str, Callable]) -> tuple[str, Callable | None, dict, Any]:
    """(name, function, arguments, error answer) of one parsed call: the function is None when the call cannot run
    (TRL's answers: an unsupported call type, an unknown tool)."""
    if tool_call.get("type") != "function":
        name = tool_call.get("name", "unknown")
        return name, None, {}, {"error": f"Unsupported tool call type: {tool_call.get('type')}"}
    function = tool_call["function"]
    name = function["name"]
    if name not in tools:
        return name, None, {}, {"error": f"Tool {name} not found."}
    arguments = function.get("arguments") or {}
    return name, tools[name], arguments if isinstance(arguments, dict) else {}, None


def _call(tool_call: dict, tools: dict[str, Callable]) -> tuple[str, Any, bool | str]:
    """(name, result, failed) of one parsed call, as TRL runs it."""
    name, func, arguments, error = resolve_call(tool_call, tools)
    if func is None:
        return name, error, True
    try:
        return name, func(**arguments), False
    except Exception as e:  # the model's mistake, answered to the model
        return name, {"error": str(e)}, True


def call_in_turn(calls: list[tuple[dict, dict[str, Callable]]]) -> list[tuple[str, Any, bool | str]]:
    """`run_episodes`' default `call_tools`: each (tool call, the episode's tools by name) in turn, in this thread."""
    return [_call(tool_call, tools) for tool_call, tools in calls]


def start_episode(row: dict, env, tools: list[Callable], turn_tokens: TurnTokens) -> Episode:
    """An episode from its dataset row: `env.reset(**row)` (None: tools only), whose returned string is appended to
    the last user message, and the first prompt rendered with the standalone `tools` and the environment's."""
    prompt = [dict(m) for m in row["prompt"]]
    all_tools = list(tools)
    try:
        if env is not None:
            observation = env.reset(**row)
            if observation is not None:
                prompt[-1]["content"] += observation
            all_tools += environment_tools(env)
    except Exception as e:  # the environment's fault: this episode cannot be scored, the others go on
        return Episode(row=row, env=env, tools=all_tools, prompt_ids=[], finish="error",
                       error=f"reset raised {type(e).__name__}: {e}")
    return Episode(row=row, env=env, tools=all_tools, prompt_ids=turn_tokens.prompt(prompt, all_tools))


def run_episodes(tokenizer, envs: list, rows: list[dict], sample: Sample, max_completion_length: int,
                 max_tool_calling_iterations: int, turn_tokens: TurnTokens | None = None,
                 max_model_len: int | None = None, tools: list[Callable] = (), call_tools=call_in_turn
                 ) -> list[Episode]:
    """Run one episode per (env, row) to its end (env None: the standalone `tools` only). `sample(episodes,
    budgets)` returns, for each episode, the ids sampled after `episode.turn_prompts[-1]` (at most `budgets[i]` of
    them) and their log-probs. `call_tools(calls)` runs a round's calls, [(tool call, tools by name)], and returns
    (name, result, failed) for each: `failed` True for an error, `TIMED_OUT` for a call past its time limit."""
    turn_tokens = turn_tokens or TurnTokens(tokenizer)
    episodes = [start_episode(row, env, tools, turn_tokens) for env, row in zip(envs, rows, strict=True)]
    active = [e for e in episodes if not e.error]
    iteration = 0
    while active:
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
        calls = [(tool_call, {t.__name__: t for t in e.tools}) for e in calling for tool_call in e.messages[-1]["tool_calls"]]
        results = iter(call_tools(calls))
        for e in calling:
            answers = []
            for _ in e.messages[-1]["tool_calls"]:
                name, result, failed = next(results)
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
