"""Multi-turn episodes inside a generator process: TRL 1.16's `tools=` / `environment_factory=` rollouts, run where
the samples are made, token in, token out.

A `GenerationRequest` with `rows` asks for `settings.n` episodes per prompt. Each episode gets its own environment
instance (made by the run's factory for the row's `environment`, pooled and reused across requests: TRL's "construct
once, reset often"), is reset with its row, and then alternates turns sampled by this process's backend with rounds
of tool calls (`data/tool_episodes.run_episodes`: the turn-building rules and their guarantee). What this module adds
is where and how the tools run:
* the episodes of a round make their calls at once, each on one event loop thread (synchronous tools on a thread
  pool), so a slow environment holds its own episode's answer, not the other episodes'; within one episode's turn the
  calls keep TRL's order (synchronous ones one after another, then the `async def` ones together), since they share
  its environment;
* a call past `tool_timeout` seconds from its start answers `{"error": "tool ... timed out after ... s"}` to the
  model and is counted (`tool_timeouts`, and as a failure); the episode's later calls of that turn are not run
  (answered as such, failures); its environment instance is not reused, since its call may still be running;
* an exception in `reset` or `get_reward` leaves the episode unscorable (`Completion.episode["error"]`, its reward
  NaN, out of its group's statistics), never the generator's death.
Every sampled token keeps its behaviour log-prob and mask 1; tool answers mask 0 (`Completion.mask`). Weights load
between requests, and with `weight_load='in_flight'` also between two turns (`serve_loops.serve_batches`' `between
_turns`): an episode whose turns were sampled by more than one version records them in `Completion.version_starts`
([version, first token] at the first sampled token of each turn with a new version); one version: left empty (the
batch's `policy_version`, the version the request started with, which is the oldest).

The environment's `get_reward()` (sync or async) runs here at the episode's end and travels as a number
(`episode["rewards"]`, keyed by the environment's class name); reward functions on the learner get `environments=` as
snapshots of each environment's public attributes at the end (`episode["state"]`, JSON values only).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from async_rlhf.data.tool_episodes import (TIMED_OUT, Answer, Episode, TurnCalls, TurnTokens, run_episodes,
                                          turn_in_order)
from async_rlhf.types import Completion, GenerationRequest

TOOL_THREADS = 256  # synchronous tool calls running at once in one generator (threads made as calls need them); a
# call's time limit runs from its start, and a call queued behind this many waits at most one limit more


@dataclass
class EpisodeSpec:
    """What a generator needs to run episodes (crosses the spawn boundary by pickle: factories and tools must be
    importable module-level callables, checked at the trainer's start)."""

    tokenizer: Any  # the processing class: chat template (the training template when needed) and response parser
    environment_factories: dict | None  # {environment name (None: the only one): factory}; None: tools only
    tools: list = field(default_factory=list)  # standalone tools, beside each environment's methods
    max_completion_length: int = 256  # ids after the first prompt, sampled and answered, per episode
    max_tool_calling_iterations: int | None = None  # rounds of tool calls; None: no limit
    tool_timeout: float = 60.0  # seconds a tool call may take
    chat_template_kwargs: dict = field(default_factory=dict)
    max_model_len: int | None = None  # the model's context: an answer that would reach it ends the episode


class EpisodeRunner:
    """Runs the episodes of one request at a time with `backend.generate` (any backend: vLLM or transformers)."""

    def __init__(self, spec: EpisodeSpec, backend):
        self.spec = spec
        self.backend = backend
        self.turn_tokens = TurnTokens(spec.tokenizer, spec.chat_template_kwargs)
        self.threads = concurrent.futures.ThreadPoolExecutor(TOOL_THREADS, thread_name_prefix="tool")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.free: dict = {name: [] for name in (spec.environment_factories or {})}  # reusable instances

    # ---- one request ---------------------------------------------------------------------------------------
    def run(self, request: GenerationRequest, version: int = 0,
            between_turns: Callable[[], int] | None = None) -> tuple[list[list[int]], list[list[Completion]]]:
        """(each group's prompt ids, [P][n] completions) of the request's episodes, started with weights `version`;
        `between_turns()`, called before each turn after the first, may load newer weights and returns the version
        loaded."""
        n = request.settings.n
        rows = [request.rows[p] for p in range(len(request.rows)) for _ in range(n)]
        names = [self._environment_name(row) for row in rows]
        envs = [self._take(name) for name in names]
        rounds = iter(range(1 << 30))
        settings = request.settings

        spans: dict[int, list[list[int]]] = {}  # id(episode) -> [[version, first completion token], ...]
        stops: dict[int, str] = {}  # id(episode) -> how its last sampled turn ended, as the backend says
        current = version

        def sample(episodes: list[Episode], budgets: list[int]):
            # each round its own seeds (sample k of round r: seed + r * 1_000_003 + k), so a resumed or regenerated
            # request draws the same episodes
            nonlocal current
            r = next(rounds)
            if r and between_turns is not None:
                current = between_turns()
            seed = None if settings.seed is None else settings.seed + r * 1_000_003
            one = dataclasses.replace(settings, n=1, seed=seed, max_new_tokens=max(budgets))
            groups = self.backend.generate([e.turn_prompts[-1] for e in episodes], one, budgets)
            for e, g in zip(episodes, groups):
                stops[id(e)] = g[0].finish_reason
                own = spans.setdefault(id(e), [[current, 0]])
                if g[0].token_ids and own[-1][0] != current:
                    own.append([current, len(e.completion_ids)])  # this turn's first sampled token
            return [(g[0].token_ids, g[0].logprobs) for g in groups]

        episodes = run_episodes(self.spec.tokenizer, envs, rows, sample, self.spec.max_completion_length,
                                self._iterations(), self.turn_tokens, self.spec.max_model_len,
                                tools=self.spec.tools, call_tools=self.call_tools,
                                multi_environment=list(self.spec.environment_factories or [None]) != [None])
        completions = [self._completion(e, name, spans.get(id(e), []), stops.get(id(e), "length"))
                       for e, name in zip(episodes, names)]
        for e, name in zip(episodes, names):
            if e.env is not None and not e.tool_timeouts:  # a timed-out call may still run: not reused
                self.free[name].append(e.env)
        groups = [completions[p * n:(p + 1) * n] for p in range(len(request.rows))]
        prompts = []
        for p, group in enumerate(groups):
            own = [c.prompt_token_ids for c in group if c.prompt_token_ids]
            prompt = own[0] if own else list(request.prompt_token_ids[p])
            prompts.append(prompt)
            groups[p] = [c if c.prompt_token_ids != prompt else dataclasses.replace(c, prompt_token_ids=[])
                         for c in group]
        return prompts, groups

    def _iterations(self) -> int:
        limit = self.spec.max_tool_calling_iterations
        return limit if limit is not None else 1 << 30

    def _environment_name(self, row: dict):
        factories = self.spec.environment_factories
        if factories is None:
            return None
        if list(factories) == [None]:
            return None
        name = row.get("environment")
        if name not in factories:  # checked on the learner before the run; a row may still come from elsewhere
            raise ValueError(f"row has environment={name!r}, not among the environments {sorted(map(str, factories))}")
        return name

    def _take(self, name):
        if self.spec.environment_factories is None:
            return None
        free = self.free[name]
        return free.pop() if free else self.spec.environment_factories[name]()

    # ---- tools ---------------------------------------------------------------------------------------------
    def _event_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="tool-event-loop", daemon=True).start()
        return self._loop

    def call_tools(self, turns: list[TurnCalls]) -> list[list[Answer]]:
        """`run_episodes`' `call_tools`: the episodes' calls at once, each within `tool_timeout` seconds of its start
        (module docstring)."""
        if not turns:
            return []
        future = asyncio.run_coroutine_threadsafe(self._round(turns), self._event_loop())
        longest = max(len(calls) for calls, _ in turns)
        limit = 2 * self.spec.tool_timeout * longest + 60.0  # each call: a queued wait and a run, each bounded
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RuntimeError(f"a round of tool calls took over {limit:g} s though every call has a "
                               f"{self.spec.tool_timeout:g} s limit: the tool event loop is blocked (an `async def` "
                               "tool that does not await?)") from None

    async def _round(self, turns: list[TurnCalls]) -> list[list[Answer]]:
        return list(await asyncio.gather(*(turn_in_order(calls, tools, self._sync_call, self._bounded)
                                           for calls, tools in turns)))

    async def _sync_call(self, name: str, func: Callable, arguments: dict) -> Answer:
        loop = asyncio.get_running_loop()
        started = loop.create_future()

        def work():
            loop.call_soon_threadsafe(_settle, started)
            return func(**arguments)

        done = loop.run_in_executor(self.threads, work)
        waited, _ = await asyncio.wait({started}, timeout=self.spec.tool_timeout)
        if not waited:  # every tool thread busy (calls past their limit hold theirs) for a whole limit
            done.cancel()
            return name, {"error": f"tool {name!r} waited {self.spec.tool_timeout:g} s for one of "
                                   f"{TOOL_THREADS} tool threads"}, TIMED_OUT
        return await self._bounded(name, done)

    async def _bounded(self, name: str, awaitable) -> Answer:
        """(name, result, False), or the error answer of a call that raised or ran past `tool_timeout`."""
        task = asyncio.ensure_future(awaitable)
        finished, _ = await asyncio.wait({task}, timeout=self.spec.tool_timeout)
        if not finished:
            task.cancel()  # an async tool is cancelled; a thread's call runs on, unheard
            return name, {"error": f"tool {name!r} timed out after {self.spec.tool_timeout:g} s"}, TIMED_OUT
        try:
            return name, task.result(), False
        except Exception as e:  # the model's mistake (or the tool's), answered to the model
            return name, {"error": str(e)}, True

    def _reward(self, env) -> tuple[dict, str]:
        """({class name: get_reward()}, error): {} when the environment has no `get_reward`."""
        get_reward = getattr(env, "get_reward", None)
        if env is None or get_reward is None:
            return {}, ""
        try:
            if inspect.iscoroutinefunction(get_reward):
                value = asyncio.run_coroutine_threadsafe(get_reward(), self._event_loop()).result(
                    timeout=self.spec.tool_timeout)
            else:
                value = get_reward()
            value = None if value is None else float(value)
        except Exception as e:
            return {}, f"get_reward raised {type(e).__name__}: {e}"
        return {type(env).__name__: value}, ""

    def _completion(self, e: Episode, name, spans: list[list[int]], last_stop: str) -> Completion:
        """The episode as one sample. It finished ("stop") when it ends on a sampled turn that the backend ended at
        an end-of-sequence id (every one the model's generation config declares, as TRL counts them); ending on a
        tool answer (the budget filled) or cut by the budget is "length"."""
        rewards, error = ({}, "") if e.error else self._reward(e.env)
        ids = e.completion_ids
        finish = last_stop if ids and e.mask[-1] == 1 else "length"
        episode = {"turns": e.turns, "tool_calls": e.tool_calls, "tool_failures": e.tool_failures,
                   "tool_timeouts": e.tool_timeouts, "finish": e.finish, "messages": _json(e.messages),
                   "prompt": _json(e.prompt),
                   "env": type(e.env).__name__ if e.env is not None else "", "environment": name,
                   "rewards": rewards, "state": snapshot(e.env), "error": e.error or error}
        return Completion(token_ids=list(ids), logprobs=list(e.logprobs), finish_reason=finish, mask=list(e.mask),
                          prompt_token_ids=list(e.prompt_ids), episode=episode,
                          version_starts=spans if len(spans) > 1 else [])

    def close(self) -> None:
        self.threads.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)


def _settle(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def snapshot(env) -> dict:
    """The environment's public attributes that are JSON values (what reward functions see as `environments=`)."""
    if env is None:
        return {}
    out = {}
    for key, value in vars(env).items():
        if key.startswith("_"):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        out[key] = value
    return out


def _json(messages: list[dict]) -> list[dict]:
    """Parsed messages with anything that is not a JSON value written as its text."""
    return json.loads(json.dumps(messages, default=str))
