"""Configuration: transformers' `TrainingArguments` plus the asynchronous fields, grouped by concern.

`AsyncRLConfig` holds what every asynchronous learner shares, each concern declared in its own module and mixed in
under TRL-style flat names (the CLI and YAML see one flat list): staleness (`config/staleness.py`), generators
(`config/generators.py`), weights (`config/weights.py`), sampling (`config/sampling.py`), scoring
(`config/scoring.py`), the learner's models (`config/learner.py`), TRL's generation fields where what each becomes
here is explained (`config/trl_fields.py`) and the optional schedules' fields (`config/experimental.py`).
`config/algorithms.py` adds each learner's own fields (online DPO, RLOO, PPO, GRPO, best-of-n) with TRL 1.16's
names. Every field is validated in `__post_init__`, before any model loads, with a message naming the field: first
the type (and finiteness) of every field we declare, then ranges and relations, all in `config/checks.py`
(`check_types`, `check_ranges`, the option pairs refused in `UNSUPPORTED`); an algorithm's own fields are checked by
its class (`algorithms.py`).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from transformers import TrainingArguments

from async_rlhf.config.checks import (
    check_combinations,
    check_counts,
    check_dir,
    check_elastic,
    check_generator_servers,
    check_ranges,
    check_types,
    check_weight_transport,
    comma_list,
)
from async_rlhf.config.experimental import ExperimentalFields
from async_rlhf.config.generators import GeneratorFields
from async_rlhf.config.learner import LearnerFields
from async_rlhf.config.sampling import SamplingFields
from async_rlhf.config.scoring import ScoringFields
from async_rlhf.config.staleness import StalenessFields
from async_rlhf.config.trl_fields import TRLGenerationFields, apply_trl_fields
from async_rlhf.config.weights import WeightFields


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class AsyncRLConfig(ExperimentalFields, TRLGenerationFields, LearnerFields, ScoringFields, SamplingFields, WeightFields,
                    GeneratorFields, StalenessFields, TrainingArguments):
    min_generations = 2  # class constant (not a field): pairs / leave-one-out need two samples per prompt
    # ---- TrainingArguments defaults that differ (CPU-sized, nothing phones home) -----------------------------
    remove_unused_columns: bool = False
    logging_steps: float = 1
    save_strategy: str = "no"

    def __post_init__(self):
        self.generator_devices = comma_list(self.generator_devices)
        self.normalize_experimental()
        if self.generator_servers is not None:
            self.generator_servers = comma_list(self.generator_servers)
        check_types(self)
        apply_trl_fields(self)
        check_types(self)  # again: generation_kwargs may have set sampling fields
        self.settle_mini_batches()
        if self.generator_threads is None:
            self.generator_threads = max(1, (os.cpu_count() or 2) // 2)
        check_ranges(self)
        check_generator_servers(self)
        check_counts(self)
        self.check_experimental()
        check_elastic(self)
        check_combinations(self)
        check_dir("shm_dir", self.shm_dir)
        check_weight_transport(self)
        if not _cuda_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1 and self.ddp_backend is None:
            # several CPU learner ranks: accelerate's multi-GPU launcher on a CPU-only machine needs gloo
            self.ddp_backend, self.use_cpu = "gloo", True
        if self.disable_tqdm is None and not sys.stderr.isatty():
            # Piped or written to a file, tqdm's bar is one "\r"-separated redraw per step, blanked with spaces before
            # every metric dict: viewers that break lines at "\r" (CI logs, `tee`d files) show a column of blank lines
            # between the dicts. Off a terminal the dicts alone then, one a line (transformers' PrinterCallback).
            self.disable_tqdm = True
        super().__post_init__()

    @property
    def groups_per_micro_batch(self) -> int:
        """Prompt groups per rank per micro-batch: per_device_train_batch_size here; the group learners (GRPO,
        RLOO) count it in completions, as TRL does (`AsyncGroupRLConfig`)."""
        return self.per_device_train_batch_size

    @property
    def prompts_per_step(self) -> int:
        """Prompts consumed by one optimizer step across all learner ranks."""
        return self.groups_per_micro_batch * self.world_size * self.gradient_accumulation_steps
