"""TRL 1.16's multi-turn arguments on our group trainers: `tools=[...]` and `environment_factory=Factory | {name:
Factory}` of `GRPOTrainer`, checked and turned into what the generators run (`generation/engine/episodes.py`).

At construction, before any model loads (TRL's checks, then ours):
* each factory is probed once: its instance must define `reset`; every other public method is a tool, whose schema
  comes from its type hints and docstring (transformers' `get_json_schema`: a tool it cannot describe is refused
  here, naming it); a class with `get_reward` owns a reward, named after the class, weight 1 (`EnvironmentReward`);
* the chat template must render a tool-calling conversation (`supports_tool_calling`); the response parser is added
  for known templates (`add_response_schema`); a template that is not prefix-preserving is replaced by TRL's training
  variant (`get_training_chat_template`), or refused naming the fix when TRL has none;
* factories and tools must pickle (they cross to generator processes; TRL's async trainer requires the same): one
  that does not is refused, naming it;
* a dict of factories routes each row by its `environment` column: a row naming none of them is refused, naming it.
Then the prompts are rendered with their tools (the ids the generators start from when `reset` adds nothing), and
every kept row travels with its requests (`GenerationRequest.rows`): the generator resets its environment with it.
"""

from __future__ import annotations

import copy
import inspect
import json
import logging
import pickle

from async_rlhf.errors import ConfigError, DatasetError
from async_rlhf.scoring.rewards import EnvironmentReward


def start_multi_turn(tools, environment_factory, args=None) -> MultiTurn | None:
    """The trainer's `MultiTurn`, or None without tools and environments (single-turn samples: then a set
    `chat_template_kwargs`, which only episodes apply, is named in a warning)."""
    if not tools and environment_factory is None:
        if args is not None and getattr(args, "chat_template_kwargs", None):
            logging.getLogger(__name__).warning(
                "chat_template_kwargs=%r: applied to multi-turn episodes only (tools / environment_factory); "
                "single-turn prompts are rendered with the chat template as is", args.chat_template_kwargs)
        return None
    return MultiTurn(tools, environment_factory)


class MultiTurn:
    """A trainer's tools and environments, checked."""

    def __init__(self, tools=None, environment_factory=None):
        self.tools = list(tools or [])
        self.multi = isinstance(environment_factory, dict)
        if environment_factory is None:
            self.factories = None
        elif self.multi:
            self.factories = dict(environment_factory)
        else:
            self.factories = {None: environment_factory}
        self.env_tools: dict = {}  # environment name -> its methods' names (as tools)
        self.reward_classes: list[str] = []  # environment classes that own a reward (get_reward), in order
        self.instances: dict = {}  # environment name -> the one instance made here (schemas, prompts: never reset)
        for name, factory in (self.factories or {}).items():
            _check_pickles(factory, f"environment_factory{'' if name is None else f'[{name!r}]'}")
            instance = self.instances[name] = factory()
            members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
            if "reset" not in members:
                raise ConfigError(f"environment_factory: {type(instance).__name__} has no `reset` method; each "
                                  "environment returned by `environment_factory` must define a callable `reset`")
            methods = [getattr(instance, m) for m in members if m not in ("reset", "get_reward") and not m.startswith("_")]
            for method in methods:
                _check_schema(method, f"{type(instance).__name__}.{method.__name__}")
            self.env_tools[name] = [m.__name__ for m in methods]
            if "get_reward" in members and type(instance).__name__ not in self.reward_classes:
                self.reward_classes.append(type(instance).__name__)
        for tool in self.tools:
            _check_pickles(tool, f"tools: {getattr(tool, '__name__', tool)!r}")
            _check_schema(tool, getattr(tool, "__name__", repr(tool)))
        self.chat_template: str | None = None

    def check_args(self, args) -> None:
        """The config fields episodes use, and the serving they need (before anything starts)."""
        if not args.tool_timeout > 0:
            raise ConfigError(f"tool_timeout: must be > 0 seconds, got {args.tool_timeout}")
        limit = args.max_tool_calling_iterations
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 0):
            raise ConfigError(f"max_tool_calling_iterations: must be None or an integer >= 0, got {limit!r}")
        if args.generator_servers:
            raise ConfigError("tools / environment_factory: episodes run inside our generator processes; "
                              f"generator_servers={args.generator_servers} (vLLM servers) cannot run them. Leave "
                              "generator_servers empty")
        if args.generation_mode == "auto":  # episodes run on batch-level serving
            args.generation_mode = "batch"
        if args.streaming:
            raise ConfigError(f"tools / environment_factory: episodes run on batch-level serving; "
                              f"generation_mode={args.generation_mode!r} (with generator_backend="
                              f"{args.generator_backend!r}) streams. Set generation_mode='batch', and turn off any "
                              "option that needs streaming generators (the config's check names them)")

    @property
    def active(self) -> bool:
        return bool(self.tools or self.factories)

    def reward_funcs(self, reward_funcs) -> list:
        """The trainer's reward functions with one `EnvironmentReward` per environment class that owns a reward."""
        funcs = [] if reward_funcs is None else list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) \
            else [reward_funcs]
        funcs += [EnvironmentReward(name) for name in self.reward_classes]
        if not funcs:
            raise ConfigError("reward_funcs: no reward source; pass reward_funcs, or an environment_factory whose "
                              "environment defines a `get_reward` method")
        return funcs

    def prepare_tokenizer(self, tokenizer):
        """TRL's template checks and set-up (module docstring); the tokenizer, with its response parser."""
        from trl.chat_template_utils import (
            add_response_schema,
            get_training_chat_template,
            is_chat_template_prefix_preserving,
            supports_tool_calling,
        )

        if not supports_tool_calling(tokenizer):
            raise ConfigError("processing_class: the chat template does not support tool calling; it must render a "
                              "full tool-calling conversation (user -> assistant with tool_calls -> tool)")
        if getattr(tokenizer, "response_template", None) is None and getattr(tokenizer, "response_schema", None) is None:
            tokenizer = add_response_schema(tokenizer)
        if not is_chat_template_prefix_preserving(tokenizer):
            try:
                self.chat_template = get_training_chat_template(tokenizer)
            except Exception as e:
                raise ConfigError(
                    "processing_class: the chat template is not prefix-preserving (rendering a conversation with one "
                    "more turn changes the ids of the earlier turns), so turn n+1's prompt would not extend turn n's, "
                    f"and TRL has no training variant of it ({e}). Set `processing_class.chat_template` to a "
                    "prefix-preserving template (TRL's `trl/chat_templates/*_training.jinja` show the fix: render "
                    "past assistant turns exactly as the model samples them)") from e
        return tokenizer

    def rendering_tokenizer(self, tokenizer):
        """The tokenizer the generators render with: a copy carrying the training template when one replaced the
        original."""
        if self.chat_template is None:
            return tokenizer
        out = copy.deepcopy(tokenizer)
        out.chat_template = self.chat_template
        return out

    def prompt_ids(self, dataset, tokenizer, max_prompt_length: int, chat_template_kwargs: dict
                   ) -> tuple[list[list[int]], list[int], list[dict]]:
        """(each kept row's first prompt rendered with its tools, kept row indices, the kept rows as JSON values)."""
        from async_rlhf.data.tool_episodes import TurnTokens

        if "prompt" not in dataset.column_names:
            raise DatasetError("train_dataset: episodes need a 'prompt' column of chat messages")
        turn_tokens = TurnTokens(self.rendering_tokenizer(tokenizer), chat_template_kwargs)
        stubs = {}  # environment name -> the tools its rows are rendered with (one instance per environment)
        ids, kept, rows, too_long = [], [], [], []
        for index in range(len(dataset)):
            row = dataset[index]
            prompt = row["prompt"]
            if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) for m in prompt):
                raise DatasetError(f"train_dataset: row {index}, column 'prompt': episodes need chat messages "
                                   f"([{{'role': ..., 'content': ...}}, ...]), got {type(prompt).__name__}")
            name = row.get("environment") if self.multi else None
            if self.factories is not None and name not in self.factories:
                raise DatasetError(f"train_dataset: row {index}, column 'environment': {name!r} is not among the "
                                   f"environments passed to environment_factory: {sorted(map(str, self.factories))}")
            if name not in stubs:
                stubs[name] = self._tool_stubs(name)
            tokens = turn_tokens.prompt(prompt, stubs[name])
            if len(tokens) > max_prompt_length:
                too_long.append(index)
                continue
            try:
                rows.append(json.loads(json.dumps(row)))
            except (TypeError, ValueError) as e:
                raise DatasetError(f"train_dataset: row {index} is not made of JSON values, which an environment's "
                                   f"reset(**row) gets in the generator process: {e}") from e
            ids.append(tokens)
            kept.append(index)
        if not ids:
            raise DatasetError(f"train_dataset: every prompt rendered with its tools is longer than max_length - "
                               f"max_new_tokens = {max_prompt_length} tokens (rows {too_long[:10]})")
        return ids, kept, rows

    def _tool_stubs(self, name) -> list:
        """The tools a row's prompt is rendered with: standalone ones and its environment's (of the instance the
        checks made: the learner calls each factory once, as TRL's checks do)."""
        tools = list(self.tools)
        if self.factories is not None:
            tools += [getattr(self.instances[name], m) for m in self.env_tools[name]]
        return tools

    def spec(self, tokenizer, args):
        """The generators' `EpisodeSpec`."""
        from async_rlhf.generation.engine.episodes import EpisodeSpec

        return EpisodeSpec(tokenizer=self.rendering_tokenizer(tokenizer), environment_factories=self.factories,
                           tools=self.tools, max_completion_length=args.max_new_tokens,
                           max_tool_calling_iterations=args.max_tool_calling_iterations,
                           tool_timeout=args.tool_timeout, chat_template_kwargs=dict(args.chat_template_kwargs or {}),
                           max_model_len=args.max_length)


def _check_pickles(obj, what: str) -> None:
    try:
        pickle.dumps(obj)
    except Exception as e:
        raise ConfigError(f"{what}: cannot be pickled ({type(e).__name__}: {e}); generators run episodes in their "
                          "own processes, so factories and tools must be module-level classes or functions (not "
                          "lambdas or closures)") from e


def _check_schema(func, what: str) -> None:
    from transformers.utils import get_json_schema

    try:
        get_json_schema(func)
    except Exception as e:
        raise ConfigError(f"tool {what}: no schema can be built for it ({type(e).__name__}: {e}); a tool needs type "
                          "hints and a docstring with an Args section describing each argument") from e
