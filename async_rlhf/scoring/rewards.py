"""Scoring completions: a batch's rows become `ScoredGroup`s; reward models, reward functions, their weighted sum,
penalties and failure policy; picking the best and worst completion of a group.

A reward function is either a callable `f(prompts, completions, completion_ids, **columns) -> list[float|None]`
(TRL's convention: text in, one score per completion), a sequence-classification model (its logit 0 on
prompt + completion text), or a path to such a model. Several are combined with `reward_weights`.

`RewardScorer.trl_arguments` (the group learners, GRPO and RLOO, set it: `trl_reward_arguments`) makes a function
receive exactly what TRL 1.16's GRPOTrainer / RLOOTrainer passes: `prompts` as the dataset has them (text, or message
lists for conversational data), `completions` as text, or `[{"role": "assistant", "content": text}]` for
conversational data, `completion_ids`, every other column by name, `trainer_state` (the Trainer's `state`),
`log_extra` and `log_metric`; a reward model then scores the reward tokenizer's chat template over prompt and
completion messages (conversational) or prompt + completion text, without added special tokens. None (or NaN) from a
function is NaN, as in TRL: the functions' weighted scores are summed ignoring NaN, and a completion that no function
scored is NaN (left out of its group's statistics, advantage 0). Without it (online DPO, PPO, best-of-n) a function
gets the chat-templated prompt text and the completion text.

Bad rewards (an exception; without `trl_arguments` also None, NaN or inf; with it inf) follow `reward_failure`:
"raise" fails naming the function and the prompt id; "skip" marks the sample invalid (its score becomes NaN) and
counts it. A function that raises under
"skip" is logged (a warning with its exception and traceback) the first time, and every call it raises on is counted
in `raised[name]` (metric `rewards/<name>/raised`), so a reward that always fails cannot silently train on nothing.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
from typing import Any, Callable

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel

from async_rlhf.data.prompts import prompt_text
from async_rlhf.errors import RewardError
from async_rlhf.scoring.reward_prefix import shared_prefix_scores, supports_shared_prefix
from async_rlhf.types import RolloutBatch, ScoredGroup

logger = logging.getLogger(__name__)


def reward_name(func) -> str:
    if isinstance(func, PreTrainedModel):
        return func.config._name_or_path.rstrip("/").split("/")[-1] or type(func).__name__
    return getattr(func, "__name__", type(func).__name__)


class RewardScorer:
    def __init__(self, reward_funcs, reward_weights=None, reward_processing_classes=None,
                 missing_eos_penalty: float | None = None, failure: str = "raise", device="cpu", prepare_model=None,
                 shared_prefix: bool = False):
        """`prepare_model(model) -> callable model` places a reward model (the trainer passes one that wraps it in a
        DeepSpeed inference engine under DeepSpeed); default: move it to `device`. `shared_prefix`: a reward model
        runs the tokens a prompt's completions share once (`scoring/reward_prefix.py`), where the model allows it."""
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs or any(f is None for f in funcs):
            raise ValueError("reward_funcs: at least one reward function or reward model is required")
        procs = reward_processing_classes
        procs = procs if isinstance(procs, (list, tuple)) else [procs] * len(funcs)
        self.funcs: list[Any] = []
        self.tokenizers: list[Any] = []
        self.is_model: list[bool] = []
        self.names: list[str] = []
        for f, proc in zip(funcs, procs):
            if isinstance(f, str):
                proc = proc or AutoTokenizer.from_pretrained(f)
                f = AutoModelForSequenceClassification.from_pretrained(f, num_labels=1)
            is_model = isinstance(f, PreTrainedModel)
            self.names.append(reward_name(f))
            if is_model:
                proc = proc or AutoTokenizer.from_pretrained(f.config._name_or_path)
                if proc.pad_token_id is None:  # as TRL: pad with EOS, and tell the model which id pads (it scores
                    proc.pad_token = proc.eos_token  # the last non-pad token of each row)
                f.config.get_text_config().pad_token_id = proc.pad_token_id
                f = prepare_model(f) if prepare_model else f.to(device).eval().requires_grad_(False)
            elif not callable(f):
                raise TypeError(f"reward_funcs: {f!r} is not a callable, a model or a path")
            self.funcs.append(f)
            self.tokenizers.append(proc)
            self.is_model.append(is_model)
        weights = reward_weights if reward_weights is not None else [1.0] * len(self.funcs)
        if len(weights) != len(self.funcs):
            raise ValueError(f"reward_weights: {len(weights)} weight(s) for {len(self.funcs)} reward function(s)")
        self.weights = torch.tensor(weights, dtype=torch.float32)
        self.missing_eos_penalty = missing_eos_penalty
        self.failure = failure
        self.device = device
        self.shared_prefix = shared_prefix
        self.skipped = 0
        self.raised: collections.Counter[str] = collections.Counter()  # reward name -> calls that raised ("skip")
        self.trl_arguments = False  # see the module docstring; set by `trl_reward_arguments`
        self.extra_kwargs: Callable[[], dict] = dict  # more keyword arguments for every function (with trl_arguments)

    @torch.no_grad()
    def _model_scores(self, model, tokenizer, prompts: list[str], completions: list[str],
                      raw_prompts: list | None = None, episode_messages: list | None = None) -> list[float]:
        if self.trl_arguments and raw_prompts is not None and isinstance(raw_prompts[0], list):
            # TRL: the reward tokenizer's own chat template over the prompt and completion messages (a multi-turn
            # episode's: its turns and the tools' answers)
            replies = episode_messages or [[{"role": "assistant", "content": c}] for c in completions]
            texts = [tokenizer.apply_chat_template(p + r, tokenize=False) for p, r in zip(raw_prompts, replies)]
        elif self.trl_arguments and raw_prompts is not None:
            texts = [p + c for p, c in zip(raw_prompts, completions)]
        else:
            texts = [p + c for p, c in zip(prompts, completions)]
        if self.shared_prefix and supports_shared_prefix(model) and not self.trl_arguments:
            rows = tokenizer(texts, truncation=True)["input_ids"]
            scores = shared_prefix_scores(model, rows, prompts, self.device)
            if scores is not None:
                return scores
        enc = tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                        add_special_tokens=not self.trl_arguments).to(self.device)
        return model(**enc).logits[:, 0].float().tolist()

    def score(self, prompts: list[str], completions: list[str], completion_ids: list[list[int]],
              finished: list[bool], prompt_ids: list[int], columns: dict[str, list] | None = None,
              raw_prompts: list | None = None, episodes: list[dict] | None = None):
        """Returns (scores [N] float tensor, NaN where skipped; per-function raw scores {name: [N]}). `raw_prompts`:
        each completion's prompt as the dataset holds it (text or messages), used with `trl_arguments`. `episodes`:
        each completion's `Completion.episode` (multi-turn): functions then get its messages as the completion and
        `environments=` (`EnvironmentState`s) when the run has environments, and an unscorable episode (its
        environment failed) is kept out of every function, its score NaN."""
        if episodes and any(e.get("error") for e in episodes):
            return self._score_scorable(prompts, completions, completion_ids, finished, prompt_ids, columns,
                                        raw_prompts, episodes)
        per_func: dict[str, list[float]] = {}
        total = torch.zeros(len(completions))
        trl = self.trl_arguments and raw_prompts is not None
        if trl:
            # TRL passes every column but these (a prompt-completion dataset's demonstrations stay out)
            columns = {k: v for k, v in (columns or {}).items() if k not in ("completion", "completion_ids")}
            conversational = isinstance(raw_prompts[0], list)
            func_prompts = raw_prompts
            func_completions = [[{"role": "assistant", "content": c}] for c in completions] if conversational \
                else completions
            if episodes:  # TRL: the episode's turns as parsed, with the tools' answers, after the prompt `reset`
                # extended; the environments only where the run has them (TRL passes none for tools alone)
                func_prompts = [e.get("prompt") or p for e, p in zip(episodes, raw_prompts)]
                func_completions = [e["messages"] for e in episodes]
                if any(e.get("env") for e in episodes):
                    columns = {**columns, "environments": [EnvironmentState(e) for e in episodes]}
            unscored = torch.ones(len(completions), dtype=torch.bool)  # no function scored it (yet)
        else:
            func_prompts, func_completions = prompts, completions
        for func, tok, name, w, is_model in zip(self.funcs, self.tokenizers, self.names, self.weights, self.is_model):
            raised_now = False
            try:
                if is_model:
                    values = self._model_scores(func, tok, prompts, completions, func_prompts if trl else None,
                                                episode_messages=func_completions if trl and episodes else None)
                else:
                    extra = self.extra_kwargs() if trl else {}
                    values = func(prompts=func_prompts, completions=func_completions, completion_ids=completion_ids,
                                  **(columns or {}), **extra)
            except Exception as exc:
                if self.failure == "raise":
                    raise RewardError(f"reward function {name!r} raised on prompt ids {sorted(set(prompt_ids))}: "
                                      f"{type(exc).__name__}: {exc}") from exc
                if not self.raised[name]:
                    logger.warning("reward function %r raised (reward_failure='skip': its samples are dropped; "
                                   "further failures are counted in rewards/%s/raised, not logged): %s: %s",
                                   name, name, type(exc).__name__, exc, exc_info=exc)
                self.raised[name] += 1
                raised_now = True
                values = [None] * len(completions)
            if len(values) != len(completions):
                raise RewardError(f"reward function {name!r} returned {len(values)} scores for "
                                  f"{len(completions)} completions")
            clean, dropped = [], []
            for v, pid in zip(values, prompt_ids):
                missing = trl and not raised_now and (v is None or math.isnan(float(v)))  # TRL: None is NaN
                bad = not missing and (v is None or not math.isfinite(float(v)))
                if bad and self.failure == "raise":
                    raise RewardError(f"reward function {name!r} returned {v!r} for prompt id {pid} "
                                      "(set reward_failure='skip' to drop such samples)")
                clean.append(float("nan") if bad or missing else float(v))
                dropped.append(bad or raised_now)
            per_func[name] = clean
            if trl:  # TRL: weighted scores summed ignoring None (NaN); a raise or inf under "skip" drops the sample
                values_t = torch.tensor(clean)
                total += torch.nan_to_num(w * values_t, nan=0.0)
                total[torch.tensor(dropped)] = float("nan")
                unscored &= torch.isnan(values_t)
            else:
                total += w * torch.tensor(clean)
        if trl:
            total[unscored] = float("nan")
            if unscored.any():  # TRL's warning, with the first such row
                i = int(unscored.nonzero()[0])
                row = {k: v[i] for k, v in (columns or {}).items()}
                row.update(prompt=func_prompts[i], completion=func_completions[i])
                logger.warning("All reward functions returned None for the following kwargs:\n%s\nPlease ensure that "
                               "at least one reward function returns a valid reward.", row)
        if self.missing_eos_penalty is not None:
            total -= self.missing_eos_penalty * (~torch.tensor(finished)).float()
        self.skipped += int(torch.isnan(total).sum())
        return total, per_func

    def _score_scorable(self, prompts, completions, completion_ids, finished, prompt_ids, columns, raw_prompts,
                        episodes):
        """`score` of the episodes whose environment did not fail; the others NaN (out of their group's statistics)
        in the total and in every function's scores, counted as skipped."""
        keep = [i for i, e in enumerate(episodes) if not e.get("error")]
        total = torch.full((len(completions),), float("nan"))
        per_func = {name: [float("nan")] * len(completions) for name in self.names}
        self.skipped += len(completions) - len(keep)
        if not keep:
            return total, per_func

        def pick(values):
            return None if values is None else [values[i] for i in keep]

        kept_total, kept_funcs = self.score(
            pick(prompts), pick(completions), pick(completion_ids), pick(finished), pick(prompt_ids),
            None if columns is None else {k: pick(v) for k, v in columns.items()}, pick(raw_prompts), pick(episodes))
        total[torch.tensor(keep)] = kept_total
        for name, values in kept_funcs.items():
            for i, value in zip(keep, values):
                per_func[name][i] = value
        return total, per_func



def score_rows(batch: RolloutBatch, rows: range, scorer: RewardScorer, tokenizer,
               dataset_row: Callable[[int], dict]) -> tuple[list[ScoredGroup], dict[str, float]]:
    """The prompts `rows` of `batch` with their completions scored, and this scoring's metrics. A batch that arrives
    already scored (`batch.rewards`, see `score_part`) is not scored again.

    `dataset_row(prompt_id)` returns the prompt's dataset row: its `prompt` (text or chat messages) is what the
    reward sees (the exact text the policy was conditioned on), every other column is passed to reward functions
    by name, as TRL does. Metrics: `rewards/<name>/mean` and `/std` per reward function (finite scores only),
    `val/contain_eos_token`, `generator/completion_length`."""
    eos = tokenizer.eos_token_id
    if batch.rewards:
        scores = [_nan(v) for r in rows for v in batch.rewards[r]]
        per_func = {name: [_nan(v) for r in rows for v in values[r]] for name, values in batch.reward_components.items()}
    else:
        scores, per_func = _score(batch, rows, scorer, tokenizer, dataset_row)
    completions = [c for r in rows for c in batch.completions[r]]
    finished = [_finished(c, eos) for c in completions]
    metrics = {}
    for name, values in per_func.items():
        finite = [v for v in values if math.isfinite(v)]
        metrics[f"rewards/{name}/mean"] = sum(finite) / len(finite) if finite else 0.0
        mean = metrics[f"rewards/{name}/mean"]  # TRL's nanstd: Bessel-corrected, NaN below two values (0 here)
        metrics[f"rewards/{name}/std"] = (math.sqrt(sum((v - mean) ** 2 for v in finite) / (len(finite) - 1))
                                          if len(finite) > 1 else 0.0)
    for name, count in scorer.raised.items():
        metrics[f"rewards/{name}/raised"] = float(count)  # cumulative, on the rank that scored
    metrics["val/contain_eos_token"] = sum(finished) / len(finished)
    metrics["generator/completion_length"] = sum(len(c.token_ids) for c in completions) / len(completions)
    n = len(batch.completions[rows[0]]) if len(rows) else 0
    groups = [ScoredGroup(prompt_id=batch.prompt_ids[r], prompt_token_ids=batch.prompt_token_ids[r],
                          completions=batch.completions[r], rewards=scores[i * n:(i + 1) * n],
                          policy_version=batch.policy_version)
              for i, r in enumerate(rows)]
    return groups, metrics


def score_part(part: RolloutBatch, scorer: RewardScorer, tokenizer, dataset_row: Callable[[int], dict]) -> RolloutBatch:
    """`part` with every completion scored (`rewards`, `reward_components`; None where skipped): what learner rank 0
    does as each part arrives while the rest of the batch is still being generated (inter-stage fusion)."""
    rows = range(len(part.prompt_ids))
    scores, per_func = _score(part, rows, scorer, tokenizer, dataset_row)

    def shaped(values: list[float]) -> list[list[float | None]]:
        out, i = [], 0
        for group in part.completions:
            out.append([None if math.isnan(v) else v for v in values[i:i + len(group)]])
            i += len(group)
        return out

    return dataclasses.replace(part, rewards=shaped(scores),
                               reward_components={name: shaped(v) for name, v in per_func.items()})


def score_parts(parts: list[RolloutBatch], scorer: RewardScorer, tokenizer,
                dataset_row: Callable[[int], dict]) -> list[RolloutBatch]:
    """`score_part` for several parts in one call of each reward function (one reward-model forward over all their
    samples, instead of one per part): what the scoring thread does with every part that arrived while it was busy."""
    if len(parts) == 1:
        return [score_part(parts[0], scorer, tokenizer, dataset_row)]
    merged = RolloutBatch(batch_id=0, generator_id=-1, policy_version=0,
                          prompt_ids=[i for p in parts for i in p.prompt_ids],
                          prompt_token_ids=[t for p in parts for t in p.prompt_token_ids],
                          completions=[g for p in parts for g in p.completions], seconds=0.0)
    scored = score_part(merged, scorer, tokenizer, dataset_row)
    out, start = [], 0
    for p in parts:
        end = start + len(p.prompt_ids)
        out.append(dataclasses.replace(p, rewards=scored.rewards[start:end], reward_components={
            name: values[start:end] for name, values in scored.reward_components.items()}))
        start = end
    return out


def _score(batch: RolloutBatch, rows: range, scorer: RewardScorer, tokenizer,
           dataset_row: Callable[[int], dict]) -> tuple[list[float], dict[str, list[float]]]:
    """(combined score per completion of `rows`, NaN where skipped; each reward function's raw scores)."""
    eos = tokenizer.eos_token_id
    prompts, raw_prompts, completions, comp_ids, finished, pids, episodes = [], [], [], [], [], [], []
    columns: dict[str, list] = {}
    for r in rows:
        pid = batch.prompt_ids[r]
        row = dataset_row(pid)
        text = prompt_text(row["prompt"], tokenizer)
        for c in batch.completions[r]:
            prompts.append(text)
            raw_prompts.append(row["prompt"])
            completions.append(tokenizer.decode(c.token_ids, skip_special_tokens=True))
            comp_ids.append(c.token_ids)
            finished.append(_finished(c, eos))
            pids.append(pid)
            episodes.append(c.episode)
            for name, value in row.items():
                if name != "prompt":
                    columns.setdefault(name, []).append(value)
    scores, per_func = scorer.score(prompts, completions, comp_ids, finished, pids, columns, raw_prompts=raw_prompts,
                                    episodes=episodes if any(episodes) else None)
    return scores.tolist(), per_func


class EnvironmentState:
    """What a reward function gets as one of `environments=` for a multi-turn episode: the environment lives in the
    generator process, so this is its public attributes (JSON values) at the episode's end, read as attributes, and
    `get_reward()` returns what the environment's own returned there (None without one)."""

    def __init__(self, episode: dict):
        self.__dict__.update(episode.get("state") or {})
        self._class = episode.get("env", "")
        self._rewards = episode.get("rewards") or {}

    def get_reward(self):
        return self._rewards.get(self._class)

    def __repr__(self) -> str:
        public = {k: v for k, v in vars(self).items() if not k.startswith("_")}
        return f"EnvironmentState({self._class}, {public})"


class EnvironmentReward:
    """The reward an environment class owns through `get_reward()` (TRL: one reward function per such class, named
    after it, weight 1): its value for the episodes of that class, None for the others."""

    def __init__(self, class_name: str):
        self.__name__ = class_name

    def __call__(self, environments=None, **kwargs) -> list[float | None]:
        return [e.get_reward() if e._class == self.__name__ else None for e in environments]


def trl_reward_arguments(scorer: RewardScorer, trainer) -> None:
    """Reward functions of `trainer` (GRPO, RLOO) get TRL 1.16's arguments (module docstring): `trainer_state`, and
    `log_metric(name, value)` into the trainer's metrics; `log_extra(column, values)` is accepted and dropped (no
    completions table here)."""
    scorer.trl_arguments = True
    scorer.extra_kwargs = lambda: {"trainer_state": trainer.state,  # read at each call: train() makes a new state
                                   "log_metric": lambda name, value: trainer._metrics[name].append(float(value)),
                                   "log_extra": lambda column, values: None}


def _finished(c, eos: int) -> bool:
    return c.finish_reason == "stop" or (len(c.token_ids) > 0 and c.token_ids[-1] == eos)


def _nan(v: float | None) -> float:
    return float("nan") if v is None else v


def best_and_worst(rewards: list[float]) -> tuple[int, int] | None:
    """Indices of the highest and the lowest finite reward (among equal rewards: the last as best, the first as
    worst), or None when no reward is finite. Online DPO's chosen/rejected pair; Best-of-N's best."""
    valid = [(r, i) for i, r in enumerate(rewards) if math.isfinite(r)]
    if not valid:
        return None
    return max(valid)[1], min(valid)[1]
