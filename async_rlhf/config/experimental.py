"""The optional schedules' fields, declared once here with their help and checked by `check_experimental`; every
recipe's config (`config/base.AsyncRLConfig`) has them under TRL-style flat names (`--partial_rollouts 4`).

Each option turns on a schedule of `experimental/` (which one a run gets: `experimental/schedules.py`); each is off by
default, and what it measured is in docs/performance.md. Options that cannot go together, with each other or with
the core's, are refused by `checks.check_combinations` (`UNSUPPORTED`), before anything loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rlhf.config import speculative
from async_rlhf.config.checks import (
    check_continuous_batching,
    check_speculative,
    check_staleness_bound,
    comma_list,
)
from async_rlhf.errors import ConfigError


@dataclass
class ExperimentalFields:
    """Mixed into `AsyncRLConfig`; plain fields with defaults (the dataclass machinery of the config class collects
    them after `TrainingArguments`' and before its own)."""

    # ---- the staleness rule of partial rollouts (experimental/partial_rollouts.py) -------------------------
    staleness_bound: str = field(
        default="oldest",
        metadata={
            "help": "Which token of a sample max_staleness bounds. 'oldest' (default; every shipped system's rule): "
            "every token of a sample trained at step v was sampled by a policy of version >= v - max_staleness. "
            "'newest': its newest token was, while its oldest token is only held to v - max_oldest_staleness: a "
            "sample may have started earlier if it kept generating on fresh weights (each token keeps the version "
            "and behaviour log-prob it was sampled with, so per-token corrections stay exact). Needs "
            "partial_rollouts >= 1 (groups not tied to a step, weights loaded in flight). Throughput and quality "
            "of the two rules: README, staleness."
        },
    )
    max_oldest_staleness: int | None = field(
        default=None,
        metadata={"help": "With staleness_bound 'newest': the cap on a trained sample's oldest token, "
                  ">= max_staleness (None: 2 x max_staleness). Not used with 'oldest' (the cap is max_staleness)."},
    )
    # ---- batch schedules (pipeline/batch_forming.py's seam) ------------------------------------------------
    partial_rollouts: int = field(
        default=0,
        metadata={"help": "Partial rollouts (APRIL): keep this many prompt groups in flight beyond what admission "
                  "allows; a step trains the first prompts_per_step groups to finish within the staleness bound "
                  "(oldest version first) and the unfinished ones keep generating for later steps. A group that "
                  "could only be trained past max_staleness is dropped, counted and regenerated, and its second "
                  "attempt is waited for. 0: off (each step trains its own batch). Needs generation_mode 'stream', "
                  "weight_load 'in_flight' and max_staleness >= 1."},
    )
    train_while_generating: bool = field(
        default=False,
        metadata={"help": "Train a step's micro-batches on its prompt groups as they arrive, all but the last before "
                  "the batch is whole (experimental/arrival_order.py). Needs gradient_accumulation_steps >= 2."},
    )
    # ---- generator schedules (generation/pool/scheduling.py's seam) ----------------------------------------
    tail_migration: int = field(
        default=0,
        metadata={"help": "With several streaming generators: once at most this many prompt groups of a batch are "
                  "still generating, spread over several generators, hand them to one of them (each sample continues "
                  "from its tokens so far, which keep their versions and behaviour log-probs) so that the others "
                  "serve the next batches alone. 0: off. Needs weight_load 'in_flight'."},
    )
    generator_autoscale: bool = field(
        default=False,
        metadata={"help": "Add a generator on a free generator_autoscale_devices entry when the learner waits, retire "
                  "one when generators idle, during the run, by a cost rule (experimental/autoscale_rule.py: a change "
                  "must cut the device-seconds per step by 5 percent). No request is lost; a new generator loads the "
                  "newest weights before its first request; max_staleness holds throughout."},
    )
    generator_autoscale_devices: list[str] = field(
        default_factory=list, metadata={"help": "Spare devices autoscaling may add generators on ('cpu', 'cuda:<i>')."})
    generator_autoscale_wait: float = field(
        default=0.1, metadata={"help": "Add only when the learner waited at least this fraction of a window."})
    generator_autoscale_idle: float = field(
        default=0.5, metadata={"help": "Retire only when generators idled at least this fraction of a window."})
    generator_autoscale_window: int = field(
        default=4, metadata={"help": "Optimizer steps measured per autoscaling decision (after any change)."})
    generator_autoscale_cost: float = field(
        default=1.0, metadata={"help": "Price of a generator device per second, relative to a learner device's (1)."})
    # ---- a stage of rank 0's scoring thread (experimental/fused_reference.py) ------------------------------
    reference_while_generating: bool = field(
        default=False,
        metadata={"help": "With score_while_generating, the scoring thread also computes the frozen reference "
                  "model's log-probs of each arriving part, and the learner's step skips its reference forward "
                  "(experimental/fused_reference.py). Not with a LoRA policy (its reference is the policy with adapters off). "
                  "Off by default: on 2 CPU cores it lengthened the learner's wait more than it shortened its step "
                  "(docs/performance.md)."},
    )
    # ---- speculative rollouts in local vLLM generators (config/speculative.py) -----------------------------
    speculative: str = field(
        default="off",
        metadata={"help": "Speculative decoding in local vLLM generators (config/speculative.py): 'off', 'ngram' "
                  "(prompt lookup), 'suffix' (suffix trees; needs arctic-inference), 'history' (drafts from earlier "
                  "completions of the same prompt in this run) or 'auto' (measured on the policy: the fastest, or off). "
                  "Drafts are verified by rejection sampling: samples and behaviour log-probs stay the policy's. "
                  "Needs weight_load 'drain'."},
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "Draft tokens per step with speculative decoding (1-16)."})
    # ---- transformers' continuous batching in the generators (experimental/continuous_batching/) -----------
    continuous_batching: bool = field(
        default=False,
        metadata={"help": "Generators sample with transformers' continuous batching (paged attention; "
                  "experimental/continuous_batching/) rather than static batches: streaming generators without "
                  "vLLM, each prompt group answered as it finishes, behaviour log-probs for every token, weights "
                  "loaded per weight_load ('in_flight': between two decode steps, running samples continue on the new "
                  "weights from their recomputed context, each token keeping its version). Sets "
                  "generator_backend='transformers' and generation_mode='stream' where they are 'auto' (never "
                  "chosen by generator_backend='auto' itself: not measured faster; benchmarks/continuous_batching.py). "
                  "No per-request seeds: one seed per generator, so samples are not reproducible run to run. Not "
                  "with repetition_penalty (transformers drops it), vLLM, generator_servers or "
                  "weight_transport='network'. TRL's use_transformers_continuous_batching (and use_transformers_paged) "
                  "sets it."},
    )
    continuous_batching_config: dict | str | None = field(
        default=None,
        metadata={"help": "With continuous_batching: keyword arguments of transformers' ContinuousBatchingConfig "
                  "(page_size, num_blocks, max_batch_tokens, max_memory_percent, ...; a JSON object on the command "
                  "line), over the defaults (CPU: page_size 32, max_batch_tokens 512, num_blocks for at most 32768 "
                  "tokens and 1 GiB of cache; GPU: max_memory_percent 0.5, as TRL). return_logprobs, "
                  "allow_block_sharing, use_async_batching and cpu_offload_space are fixed "
                  "(experimental/continuous_batching/backend.py says why). TRL's "
                  "transformers_continuous_batching_config sets it."},
    )

    def normalize_experimental(self) -> None:
        """Before the type checks: a single spare device given as a string becomes a list."""
        self.generator_autoscale_devices = comma_list(self.generator_autoscale_devices)

    def check_experimental(self) -> None:
        """Ranges and relations of these fields, each error naming the field (`config/checks.py`)."""
        check_continuous_batching(self)  # first: it may settle generator_backend, which the others read
        check_staleness_bound(self)
        check_speculative(self)

    def generator_engine_options(self) -> dict:
        """Keyword arguments these settings add to every local generator's engine (`generation/pool/placement.py`):
        transformers' continuous-batching config with `continuous_batching` (read by
        `experimental/continuous_batching/engine.py`'s backend); {} otherwise."""
        if not self.continuous_batching:
            return {}
        return {"continuous_batching": dict(self.continuous_batching_config or {})}

    def vllm_speculative_config(self) -> dict | None:
        """vLLM's `speculative_config` for local generators (`config/speculative.py`); None: no speculation. Called
        once 'auto' is decided."""
        return speculative.vllm_config(self.speculative, self.num_speculative_tokens)

    def needs_vllm(self) -> bool:
        """A setting here that only vLLM generators serve is on (speculative decoding, 'auto' included):
        generator_backend='auto' then takes vLLM without timing transformers (`generation/pool/backend_choice.py`)."""
        return self.speculative != "off"

    def settle_without_vllm(self, reason: str) -> list[str]:
        """generator_backend='auto' found that vLLM cannot serve the policy (`reason`): a setting here that would only
        have used it ('auto') is turned off, returned as a line to print; one that needs it is refused naming it."""
        said = []
        if self.speculative == "auto":  # nothing to measure
            self.speculative = "off"
            said.append(f"speculative='auto': off (vLLM cannot serve the policy here: {reason})")
        if self.speculative != "off":
            raise ConfigError(f"speculative: {self.speculative!r} needs vLLM generators, and generator_backend='auto' "
                              f"cannot use vLLM here: {reason}; set speculative='off'")
        if self.partial_rollouts:
            raise ConfigError(f"partial_rollouts: needs streaming vLLM generators, and generator_backend='auto' cannot "
                              f"use vLLM here: {reason}")
        return said

    def experimental_summary(self, stats: dict) -> dict:
        """The run summary's sections of these settings (`trainers/run_summary.py`), from the pipeline's stats."""
        return {"speculative": speculative.run_summary(self.speculative, self.num_speculative_tokens, stats)}

    def spare_generator_devices(self) -> dict[str, list[str]]:
        """Devices generators may be added on during the run, by the field that names them."""
        return {"generator_autoscale_devices": list(self.generator_autoscale_devices)}

    def max_token_staleness(self) -> int:
        """The most steps behind the learner any trained token may be: max_staleness under the 'oldest' rule,
        max_oldest_staleness under 'newest'."""
        return self.max_oldest_staleness if self.staleness_bound == "newest" else self.max_staleness


def summary_lines(summary: dict) -> list[str]:
    """The printed run summary's lines for `ExperimentalFields.experimental_summary`'s sections present in
    `summary`."""
    line = speculative.summary_line(summary.get("speculative", {}))
    return [line] if line else []


def server_argv(argv: list[str]) -> list[str]:
    """`python -m async_rlhf.generation.serve`'s arguments with the flags of these settings (`--speculative`)
    replaced by vLLM's own."""
    return speculative.server_argv(argv)
