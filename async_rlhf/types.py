"""Data that crosses stages: prompts go out to generators, rollouts come back, weights go out again.

Everything here is a small dataclass of plain Python values (ints, floats, strings, lists) so that it can cross
a `multiprocessing` queue between our own processes. Tensors never ride these messages: weights travel
through shared memory or a torch.distributed group (see `weight_sync/`), and the messages only say where.

Versions: `policy_version` is the number of learner optimizer steps whose weights a generator had loaded when it
sampled. Version 0 is the initial policy.

Serialisation: a message that leaves a process as JSON (a checkpoint, a broadcast to other learner ranks, a
network frame) is written with `to_dict()` and read back with `from_dict()`, which checks every field's type and
refuses unknown or missing keys, so bad input fails at the edge with a message naming the field. Numbers must be
finite: NaN and +-inf are refused wherever they are read (network frames, other ranks, checkpoints). We never write
them either: a behaviour log-prob of -inf cannot belong to a sampled token, so the pipeline fails a batch that holds
one on rank 0, naming its generator, before it is trained, broadcast or checkpointed (`pipeline/rollout_pipeline.py`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

from async_rlhf.errors import FieldError


@dataclass(frozen=True)
class SamplingSettings:
    """How a generator samples; the same for every backend."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filter
    n: int = 2  # completions per prompt
    seed: int | None = None  # per (batch, prompt, sample) with vLLM; not honoured by transformers' continuous
    # batching, which has one seed per generator (experimental/continuous_batching/backend.py)
    min_p: float = 0.0  # 0: off; else drop tokens less likely than min_p x the most likely one (after temperature)
    repetition_penalty: float = 1.0  # 1: off; else logits of tokens already in the prompt or completion: l/p if l > 0
    # else l*p (before temperature; transformers' and vLLM's definition)

    @classmethod
    def from_config(cls, args) -> SamplingSettings:
        """A run's settings, from its config (`AsyncRLConfig`: TRL's names)."""
        return cls(max_new_tokens=args.max_new_tokens, temperature=args.sampling_temperature, top_p=args.top_p,
                   top_k=args.top_k if args.top_k > 0 else -1, n=args.num_generations, seed=args.seed,
                   min_p=args.min_p or 0.0, repetition_penalty=args.repetition_penalty)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> SamplingSettings:
        f = check_fields(d, "settings", {"max_new_tokens": nonneg, "temperature": number, "top_p": number,
                                         "top_k": integer, "n": nonneg, "seed": optional(integer), "min_p": number,
                                         "repetition_penalty": number})
        if f["temperature"] < 0 or not 0 < f["top_p"] <= 1:
            raise FieldError(f"settings: temperature {f['temperature']} must be >= 0 and top_p {f['top_p']} in (0, 1]")
        if not 0 <= f["min_p"] <= 1 or not f["repetition_penalty"] > 0:
            raise FieldError(f"settings: min_p {f['min_p']} must be in [0, 1] and repetition_penalty "
                             f"{f['repetition_penalty']} > 0")
        return cls(**f)


@dataclass(frozen=True)
class Completion:
    """One sampled continuation of one prompt."""

    token_ids: list[int]  # [T] generated tokens, EOS included when it was sampled
    logprobs: list[float]  # [T] behaviour log-prob of each sampled token under the generator's policy
    finish_reason: str  # "stop" (EOS or stop token) or "length" (hit max_new_tokens)
    # [[version, first token], ...]: tokens from `first token` on were sampled by weights `version` (in order, the
    # first at token 0). Empty: every token by the batch's `policy_version` (batch-level generators).
    version_starts: list[list[int]] = field(default_factory=list)
    # name -> [T'] per-token values of the tokens the learner packs (T' <= T), filled on learner rank 0 as the part
    # arrives, for the learner's step to use instead of computing them (a scoring stage's: the fused reference puts
    # the frozen reference's log-probs under `learner/logprobs.REFERENCE`). Empty: nothing precomputed.
    token_values: dict[str, list[float]] = field(default_factory=dict)
    # Multi-turn episodes (`generation/engine/episodes.py`); all three empty for a single-turn sample.
    # [T] 1: a token the policy sampled, 0: one an environment or tool answered (trained on: mask 1 only; its
    # `logprobs` entry is 0.0). Empty: every token was sampled.
    mask: list[int] = field(default_factory=list)
    # [L] the sample's own prompt, when it differs from its group's (an environment's `reset` added to it). Empty: the
    # group's `prompt_token_ids`.
    prompt_token_ids: list[int] = field(default_factory=list)
    # what the episode was (JSON values): turns, tool_calls, tool_failures, tool_timeouts, finish, env (class name),
    # messages (its turns as parsed and the tool answers), rewards ({environment class: get_reward() or None}),
    # state (the environment's public attributes at the end), error (why it cannot be scored; "" if it can)
    episode: dict = field(default_factory=dict)

    def oldest_version(self, default: int) -> int:
        return min((v for v, _ in self.version_starts), default=default)

    @property
    def num_sampled(self) -> int:
        """Tokens the policy sampled (a tool's answers left out)."""
        return sum(self.mask) if self.mask else len(self.token_ids)

    def sampled(self, i: int) -> bool:
        """Token `i` was sampled by the policy (not an environment's answer)."""
        return not self.mask or self.mask[i] == 1

    @classmethod
    def from_dict(cls, d) -> Completion:
        if isinstance(d, dict):  # written before per-token versions / precomputed values / episodes existed
            d = {"version_starts": [], "token_values": {}, "mask": [], "prompt_token_ids": [], "episode": {},
                 **_renewed(d, RETIRED_FIELDS["completion"])}
        f = check_fields(d, "completion", {"token_ids": list_of(nonneg), "logprobs": list_of(number),
                                           "finish_reason": string, "version_starts": list_of(list_of(nonneg)),
                                           "token_values": dict_of(list_of(number)), "mask": list_of(nonneg),
                                           "prompt_token_ids": list_of(nonneg), "episode": dict_of(lambda v: v)})
        if len(f["token_ids"]) != len(f["logprobs"]) or f["finish_reason"] not in ("stop", "length"):
            raise FieldError("completion: token_ids and logprobs differ in length, or finish_reason is not "
                             "'stop'/'length'")
        if f["mask"] and (len(f["mask"]) != len(f["token_ids"]) or set(f["mask"]) - {0, 1}):
            raise FieldError(f"completion.mask: expected one 0/1 per token ({len(f['token_ids'])}), got "
                             f"{len(f['mask'])} values {sorted(set(f['mask']))}")
        for name, values in f["token_values"].items():
            if len(values) > len(f["token_ids"]):
                raise FieldError(f"completion.token_values[{name!r}]: {len(values)} values for "
                                 f"{len(f['token_ids'])} tokens")
        starts = [s[1] if len(s) == 2 else -1 for s in f["version_starts"]]
        if -1 in starts or starts[:1] not in ([], [0]) or starts != sorted(starts):
            raise FieldError(f"completion.version_starts: expected [[version, first token], ...] starting at token 0 "
                             f"in order, got {f['version_starts']}")
        return cls(**f)


@dataclass(frozen=True)
class GenerationRequest:
    """Learner -> generator: sample `settings.n` completions for each prompt of one batch."""

    kind = "generate"
    batch_id: int  # which optimizer step will train on this batch (0-based)
    prompt_ids: list[int]  # [P] index of each prompt in the prompt stream
    prompt_token_ids: list[list[int]]  # [P][L_p]
    settings: SamplingSettings
    chunk: int = 0  # a batch is split across generators: this is part `chunk` of `num_chunks`
    num_chunks: int = 1
    max_new_tokens: list[int] = field(default_factory=list)  # [P] each prompt's budget; empty: settings' for all
    # [P] each prompt's dataset row (JSON values) when its samples are multi-turn episodes: what the environment's
    # `reset(**row)` gets, its `prompt` messages and, with several environments, its `environment` name. Empty: single
    # turn, `prompt_token_ids` is what is sampled from.
    rows: list[dict] = field(default_factory=list)

    def settings_for(self, p: int) -> SamplingSettings:
        """The sampling settings of prompt `p` (its own token budget, when it has one)."""
        if not self.max_new_tokens:
            return self.settings
        return dataclasses.replace(self.settings, max_new_tokens=self.max_new_tokens[p])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> GenerationRequest:
        if isinstance(d, dict):
            d = {"max_new_tokens": [], "rows": [], **d}
        f = check_fields(d, "generate", {"batch_id": nonneg, "prompt_ids": list_of(nonneg),
                                         "prompt_token_ids": list_of(list_of(nonneg)),
                                         "settings": SamplingSettings.from_dict, "chunk": nonneg,
                                         "num_chunks": nonneg, "max_new_tokens": list_of(nonneg),
                                         "rows": list_of(dict_of(lambda v: v))},
                         ignore=("kind", "token"))
        if f["rows"] and len(f["rows"]) != len(f["prompt_ids"]):
            raise FieldError(f"generate: rows must be empty or one per prompt: {len(f['rows'])} rows, "
                             f"{len(f['prompt_ids'])} prompts")
        if len(f["prompt_ids"]) != len(f["prompt_token_ids"]):
            raise FieldError("generate: prompt_ids and prompt_token_ids differ in length")
        if f["max_new_tokens"] and len(f["max_new_tokens"]) != len(f["prompt_ids"]):
            raise FieldError("generate: max_new_tokens must be empty or hold one budget per prompt")
        return cls(**f)


@dataclass(frozen=True)
class WeightUpdate:
    """Learner -> generator: load the policy at `version`.

    transport "shm": a safetensors file in RAM (/dev/shm) at `path`; "network": the bytes arrive over the gloo
    group the generator joined (`WeightGroupJoin`), in packed buckets in `names` order, each tensor with the dtype
    and shape given here (`weight_sync/broadcast.py`); "ipc": each tensor is learner rank 0's device memory, named
    by a CUDA IPC handle per entry of `names` (`weight_sync/ipc.py`; colocated mode).
    """

    version: int
    transport: str  # "shm" | "network" | "ipc"
    path: str = ""
    names: list[str] = field(default_factory=list)  # [K] state_dict names
    num_bytes: int = 0
    dtypes: list[str] = field(default_factory=list)  # [K] torch dtype names ("float32", ...); "network" and "ipc"
    shapes: list[list[int]] = field(default_factory=list)  # [K] tensor shapes; "network" and "ipc"
    ipc_handles: list[dict] = field(default_factory=list)  # [K] {GPU UUID: reduce_tensor args}; "ipc" only
    kind = "weights"


@dataclass(frozen=True)
class WeightGroupJoin:
    """Learner -> generator: join learner rank 0's weight group (vLLM's `init_weight_transfer_engine` payload,
    `{"group": weight_sync.broadcast.GroupInfo}`); queued ahead of any "network" update."""

    init_info: dict
    kind = "weight_group"


@dataclass(frozen=True)
class Shutdown:
    """Learner -> generator: finish and exit."""

    kind = "shutdown"


@dataclass(frozen=True)
class RolloutBatch:
    """Generator -> learner: the completions for one GenerationRequest."""

    batch_id: int
    generator_id: int
    policy_version: int  # version of the weights that sampled every completion here (the oldest of any token)
    prompt_ids: list[int]  # [P]
    prompt_token_ids: list[list[int]]  # [P][L_p]
    completions: list[list[Completion]]  # [P][n]
    seconds: float  # generation wall time
    chunk: int = 0
    num_chunks: int = 1
    # filled on learner rank 0 as each part arrives, when scoring overlaps generation (`pipeline/rollout_pipeline.py`); empty: the
    # learner scores the batch itself. [P][n] combined reward (None: skipped), and each reward function's raw scores.
    rewards: list[list[float | None]] = field(default_factory=list)
    reward_components: dict[str, list[list[float | None]]] = field(default_factory=dict)
    # [P] what the batch schedule that formed this batch records about each prompt group (JSON values; partial
    # rollouts: where in the prompt stream the group came from); empty: nothing (the core's own batches)
    group_tags: list[dict] = field(default_factory=list)
    # the generator's cumulative speculative-decoding counters when it sent this (`VLLMBackend.spec_counters`: drafts,
    # draft_tokens, accepted_tokens); empty: no speculation
    spec: dict = field(default_factory=dict)
    kind = "rollouts"

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for group in self.completions for c in group)

    def first_nonfinite_logprob(self) -> tuple[int, int, int, float] | None:
        """(prompt index, completion index, token index, value) of the first NaN/inf behaviour log-prob, or None."""
        for p, group in enumerate(self.completions):
            for i, c in enumerate(group):
                for t, lp in enumerate(c.logprobs):
                    if not math.isfinite(lp):
                        return p, i, t, lp
        return None

    def sample_versions(self) -> list[list[list[int]]]:
        """[P][n] [oldest, newest] weight version of each sample's tokens (`policy_version` for batch-level ones)."""
        return [[[c.oldest_version(self.policy_version), max((v for v, _ in c.version_starts),
                                                              default=self.policy_version)] for c in group]
                for group in self.completions]

    def newest_version(self) -> int:
        """The version of the least fresh sample's newest token: min over samples of each one's newest token (what
        `staleness_bound="newest"` bounds; `policy_version`, the oldest token's, is what "oldest" bounds)."""
        return min((newest for group in self.sample_versions() for _, newest in group), default=self.policy_version)

    def group_versions(self) -> list[list[int]]:
        """[P] [oldest, newest] weight version of any token of each group (its version span)."""
        return [[min(o for o, _ in group), max(n for _, n in group)] if group else [self.policy_version] * 2
                for group in self.sample_versions()]

    @classmethod
    def merged(cls, batch_id: int, parts: list[RolloutBatch], group_tags: list[dict] | None = None) -> RolloutBatch:
        """One batch of `parts` in order; its version is the oldest part's (the bound holds for every sample). Rewards
        travel only when every part was scored."""
        scored = all(p.rewards for p in parts)
        return cls(batch_id=batch_id, generator_id=-1, policy_version=min(p.policy_version for p in parts),
                   prompt_ids=[i for p in parts for i in p.prompt_ids],
                   prompt_token_ids=[t for p in parts for t in p.prompt_token_ids],
                   completions=[c for p in parts for c in p.completions], seconds=max(p.seconds for p in parts),
                   rewards=[r for p in parts for r in p.rewards] if scored else [],
                   reward_components={name: [r for p in parts for r in p.reward_components[name]]
                                      for name in parts[0].reward_components} if scored else {},
                   group_tags=group_tags or [])

    def select(self, rows: list[int]) -> RolloutBatch:
        """The prompt groups at `rows`, in that order, with their rewards; the version is the oldest of their tokens'
        (a part's own `policy_version` where its samples carry no per-token versions)."""
        completions = [self.completions[r] for r in rows]
        version = min((c.oldest_version(self.policy_version) for g in completions for c in g),
                      default=self.policy_version)
        return dataclasses.replace(
            self, policy_version=version, prompt_ids=[self.prompt_ids[r] for r in rows],
            prompt_token_ids=[self.prompt_token_ids[r] for r in rows], completions=completions,
            rewards=[self.rewards[r] for r in rows] if self.rewards else [],
            reward_components={k: [v[r] for r in rows] for k, v in self.reward_components.items()},
            group_tags=[self.group_tags[r] for r in rows] if self.group_tags else [])

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d) -> RolloutBatch:
        """The one reader of `to_dict()`'s output: checkpoints, other learner ranks and the network all use it."""
        if isinstance(d, dict):  # written before rewards (then group tags) could travel with the rollouts
            d = {"rewards": [], "reward_components": {}, "group_tags": [], "spec": {},
                 **_renewed(d, RETIRED_FIELDS["rollouts"])}
        scores = list_of(list_of(optional(number)))
        f = check_fields(d, "rollouts", {
            "batch_id": nonneg, "generator_id": integer, "policy_version": nonneg, "prompt_ids": list_of(nonneg),
            "prompt_token_ids": list_of(list_of(nonneg)), "completions": list_of(list_of(Completion.from_dict)),
            "seconds": number, "chunk": nonneg, "num_chunks": nonneg, "rewards": scores,
            "reward_components": dict_of(scores), "group_tags": list_of(dict_of(lambda v: v)),
            "spec": dict_of(nonneg)},
            ignore=("kind", "token"))
        if not len(f["prompt_ids"]) == len(f["prompt_token_ids"]) == len(f["completions"]):
            raise FieldError(f"rollouts: {len(f['prompt_ids'])} prompt ids, {len(f['prompt_token_ids'])} prompts and "
                             f"{len(f['completions'])} completion groups")
        if f["group_tags"] and len(f["group_tags"]) != len(f["prompt_ids"]):
            raise FieldError(f"rollouts: group_tags must be empty or one per prompt ({len(f['prompt_ids'])}), got "
                             f"{len(f['group_tags'])}")
        shape = [len(g) for g in f["completions"]]
        for name, values in [("rewards", f["rewards"]), *f["reward_components"].items()]:
            if values and [len(g) for g in values] != shape:
                raise FieldError(f"rollouts: {name} has shape {[len(g) for g in values]}, completions {shape}")
        return cls(**f)


@dataclass(frozen=True)
class WeightAck:
    """Generator -> learner: the generator now samples with `version`."""

    generator_id: int
    version: int
    seconds: float  # time to receive and load
    busy_seconds: float = 0.0  # the generator's time spent sampling since it started (for its busy fraction)
    kind = "weights_loaded"


@dataclass(frozen=True)
class GeneratorReady:
    """Generator -> learner: engine started, initial weights loaded."""

    generator_id: int
    backend: str
    seconds: float
    where: str = ""  # where it runs, as its launcher names it ("": a process on learner rank 0's host)
    kind = "ready"


@dataclass(frozen=True)
class GeneratorError:
    """Generator -> learner: the generator failed; `message` holds the exception and traceback."""

    generator_id: int
    message: str
    kind = "error"


@dataclass
class ScoredGroup:
    """One prompt with its n completions and their rewards, ready for a loss."""

    prompt_id: int  # index in the prompt stream (ties a group back to its dataset row)
    prompt_token_ids: list[int]  # [L_p]
    completions: list[Completion]  # [n]
    rewards: list[float]  # [n] combined reward per completion (after penalties)
    policy_version: int  # version that sampled the completions


# ---- field checks for from_dict ----------------------------------------------------------------------------------
# Fields that files of earlier versions hold under other names, read into today's (checkpoints outlive the code):
# kind -> old field -> (today's field, the old value as today's). Only old files name these.
RETIRED_FIELDS: dict[str, dict[str, tuple[str, Callable]]] = {
    "completion": {"ref_logprobs": ("token_values", lambda v: {"ref_logprobs": v} if v else {})},
    "rollouts": {"origins": ("group_tags", lambda v: [{"origin": o} for o in v])},
}


def _renewed(d: dict, retired: dict[str, tuple[str, Callable]]) -> dict:
    """`d` with its retired fields under today's names."""
    out = {k: v for k, v in d.items() if k not in retired}
    for old, (new, convert) in retired.items():
        if old in d and new not in d:
            out[new] = convert(d[old])
    return out


def check_fields(d, kind: str, required: dict[str, Callable], ignore: tuple[str, ...] = ()) -> dict:
    """`d`'s fields converted by their checks; unknown (except `ignore`) or missing keys are an error."""
    if not isinstance(d, dict):
        raise FieldError(f"{kind}: expected an object, got {type(d).__name__}")
    unknown = set(d) - set(required) - set(ignore)
    missing = set(required) - set(d)
    if unknown or missing:
        raise FieldError(f"{kind}: unknown field(s) {sorted(unknown)}, missing field(s) {sorted(missing)}")
    out = {}
    for name, check in required.items():
        try:
            out[name] = check(d[name])
        except FieldError:
            raise
        except (TypeError, ValueError) as exc:
            raise FieldError(f"{kind}.{name}: {exc}") from None
    return out


def integer(x) -> int:
    if not isinstance(x, int) or isinstance(x, bool):
        raise TypeError(f"expected an integer, got {type(x).__name__}")
    return x


def nonneg(x) -> int:
    if integer(x) < 0:
        raise ValueError(f"expected >= 0, got {x}")
    return x


def number(x) -> float:
    """A finite number (NaN and +-inf are refused: they only come from broken numerics or a hostile peer)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"expected a number, got {type(x).__name__}")
    if not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {x}")
    return float(x)


def string(x) -> str:
    if not isinstance(x, str):
        raise TypeError(f"expected a string, got {type(x).__name__}")
    return x


def list_of(item: Callable) -> Callable:
    def check(x):
        if not isinstance(x, list):
            raise TypeError(f"expected a list, got {type(x).__name__}")
        return [item(v) for v in x]
    return check


def dict_of(item: Callable) -> Callable:
    def check(x):
        if not isinstance(x, dict) or not all(isinstance(k, str) for k in x):
            raise TypeError(f"expected an object with string keys, got {type(x).__name__}")
        return {k: item(v) for k, v in x.items()}
    return check


def optional(check: Callable) -> Callable:
    return lambda x: None if x is None else check(x)
