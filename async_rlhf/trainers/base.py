"""What every asynchronous learner shares, as a transformers `Trainer` subclass (like TRL's online trainers).

The Trainer drives optimizer steps, logging, callbacks and saving; the data does not come from its dataloader
but from the `RolloutPipeline`: the dataloader only yields one ticket per micro-batch, and `training_step`
asks the pipeline for the rollouts of the current optimizer step. A subclass implements `compute_rollout_loss`
(the algorithm, from `logprobs.sequence_terms` and a loss in `losses/`). This class only wires the stages, each of
which lives in its own module: prompts (`data/prompts.py`), frozen models (`learner/frozen_models.py`), where generators
run (`generation/pool/placement.py`), the pipeline (`pipeline/rollout_pipeline.py`), scoring (`scoring/rewards.py`), checkpoints
(`learner/checkpointing.py`) and the end-of-run summary (`trainers/run_summary.py`); and it always shuts every process down.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import tempfile
import time
import warnings

import torch
from torch.utils.data import DataLoader
from transformers import AutoConfig, AutoModelForCausalLM, Trainer

from async_rlhf.config.base import AsyncRLConfig
from async_rlhf.config.checks import check_learner_combinations
from async_rlhf.data.prompts import check_prompt_dataset, completion_budgets, tokenize_prompts
from async_rlhf.errors import ConfigError, GeneratorFailed, StageTimeout
from async_rlhf.experimental import schedules
from async_rlhf.generation.pool.choice import make_pool
from async_rlhf.generation.pool.early_start import choose_backend_and_spawn
from async_rlhf.generation.pool.placement import (
    check_context_length,
    check_generator_devices,
    check_shm_space,
    engine_kwargs,
    initial_model_dir,
)
from async_rlhf.learner import checkpointing, peft_policy
from async_rlhf.learner.frozen_models import prepare_frozen, reference_model
from async_rlhf.learner.nonfinite import NonFiniteGuard, NonFiniteSteps
from async_rlhf.pipeline.prompt_stream import total_steps
from async_rlhf.pipeline.rollout_pipeline import RolloutPipeline
from async_rlhf.scoring.rewards import RewardScorer, score_parts, score_rows
from async_rlhf.trainers import provenance
from async_rlhf.trainers.hooks import PipelineHooks, StepTickets, disable_dropout
from async_rlhf.trainers.run_summary import build_summary, format_summary
from async_rlhf.trainers.startup import StartupTimeline
from async_rlhf.trainers.trl_compat import check_trl_arguments, set_trl_attributes, tokenizer_for
from async_rlhf.types import RolloutBatch, SamplingSettings, ScoredGroup

LOG_HISTORY_KEPT = 100  # entries of `state.log_history` kept in memory; metrics.jsonl holds them all


class AsyncTrainerBase(Trainer):
    config_class = AsyncRLConfig

    _multi_turn = None  # a group trainer's tools and environments (`multi_turn.MultiTurn`), set before this runs

    def __init__(self, model, ref_model=None, reward_funcs=None, args=None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, reward_processing_classes=None, peft_config=None,
                 compute_metrics=None, callbacks=None, optimizers=(None, None), preprocess_logits_for_metrics=None):
        # ---- everything that can be checked before a model loads -------------------------------------------
        self.timeline = StartupTimeline()  # see trainers/startup.py
        self.timeline.mark("trainer_entered")
        if args is None:
            args = self.config_class(output_dir=os.path.join(tempfile.gettempdir(), "async_rlhf-output"))
        if not isinstance(args, self.config_class):
            raise ConfigError(f"args: expected {self.config_class.__name__}, got {type(args).__name__}")
        peft_policy.check_peft_config(peft_config, model)  # LoRA: see learner/peft_policy.py
        deepspeed = bool(args.deepspeed) or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
        check_learner_combinations(args, deepspeed, lora=peft_config is not None or (
            not isinstance(model, str) and peft_policy.is_peft_policy(model)))
        self.passes = getattr(args, "num_iterations", 1)  # optimizer passes per batch (policy-gradient configs)
        if self.passes > 1 and deepspeed:
            raise ConfigError(f"num_iterations: {self.passes} passes per batch are not built under DeepSpeed (its "
                              "engine steps inside backward); use 1, or DDP")
        if args.score_while_generating is None:  # auto (config/scoring.py)
            args.score_while_generating = not deepspeed
        check_prompt_dataset(train_dataset)
        reward_funcs = reward_funcs if reward_funcs is not None else args.reward_model_path
        if reward_funcs is None:
            raise ConfigError("reward_funcs: must be provided: a reward function, a reward model or a path "
                              "(or set reward_model_path)")
        check_trl_arguments(model, ref_model, reward_funcs, args, reward_processing_classes)
        check_generator_devices(args)
        check_shm_space(args, model if isinstance(model, str) else None)

        # ---- tokenizer and the policy's config: cheap, so checked before any model loads -----------------------
        self._source_model_path = model if isinstance(model, str) else None
        processing_class = tokenizer_for(processing_class, model, self._source_model_path)
        if processing_class.eos_token_id is None:
            raise ConfigError("processing_class: the tokenizer has no eos_token; set one (completions must end)")
        if processing_class.pad_token_id is None:
            processing_class.pad_token = processing_class.eos_token
        self._episodes = None  # multi-turn: the generators' `EpisodeSpec` (`multi_turn.py`)
        if self._multi_turn is not None:
            self._multi_turn.check_args(args)
            processing_class = self._multi_turn.prepare_tokenizer(processing_class)
            self._episodes = self._multi_turn.spec(processing_class, args)
        try:
            model_config = AutoConfig.from_pretrained(model) if isinstance(model, str) else model.config
        except OSError:  # no such model: raised again once the prompts are checked (they need no model)
            model_config = None
        if model_config is not None:
            check_context_length(args, model_config)

        # ---- the generator backend, then the generators, which start while the prompts are tokenized and the
        # models load (generation/pool/early_start.py) -----------------------------------------------------------------
        init_kwargs = args.model_init_kwargs or {}
        self._early_pool = None if model_config is None else choose_backend_and_spawn(
            args, model, model_config, init_kwargs, train_dataset, processing_class, schedules.stream_engine(args),
            schedules.pool_class(args), schedules.before_spawn, episodes=self._episodes)
        if self._early_pool is not None:
            self.timeline.mark("generators_spawned")
        try:
            self.episode_rows = None  # multi-turn: each prompt's row, sent with its requests
            if self._multi_turn is not None:
                self.prompt_token_ids, kept_rows, self.episode_rows = self._multi_turn.prompt_ids(
                    train_dataset, processing_class, args.max_length - args.max_new_tokens,
                    dict(args.chat_template_kwargs or {}))
            else:
                self.prompt_token_ids, kept_rows = tokenize_prompts(
                    train_dataset, processing_class, args.max_length - args.max_new_tokens)
            self.prompt_rows = kept_rows  # prompt id -> dataset row
            self.prompt_budgets = completion_budgets(train_dataset, kept_rows, args.max_new_tokens)  # None: one for all
            if model_config is None:
                AutoConfig.from_pretrained(model)  # raises the loader's own error
            self._build(model, ref_model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
                        reward_processing_classes, peft_config, compute_metrics, callbacks, optimizers,
                        preprocess_logits_for_metrics, init_kwargs)
        except BaseException:
            self._close_early_pool()
            raise

    def _pool_maker(self, model_dir: str, kwargs: dict):
        """The pipeline's `make_pool` (`pipeline/generator_pool.MakePool`): this run's pool, transport and generator
        schedule, adopting the generators spawned while the trainer was built (`early_start.py`) if they fit."""
        def make(on_rollouts, initial_version: int):
            early, self._early_pool = self._early_pool, None
            return make_pool(self.args, on_rollouts, initial_version, model_path=model_dir, engine_kwargs=kwargs,
                             early_pool=early, device=self.accelerator.device,
                             scheduling=schedules.generator_scheduling(self.args, self.accelerator.num_processes),
                             stream_engine=schedules.stream_engine(self.args),
                             pool_class=schedules.pool_class(self.args), episodes=self._episodes)
        return make

    def _close_early_pool(self) -> None:
        if self._early_pool is not None:
            self._early_pool.close()
            self._early_pool = None

    def _build(self, model, ref_model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
               reward_processing_classes, peft_config, compute_metrics, callbacks, optimizers,
               preprocess_logits_for_metrics, init_kwargs):
        """The constructor's expensive part: models, the Trainer, the reward scorer."""
        # DeepSpeed 0.19's ZeRO-3 calls two collectives torch 2.13 deprecated, and the filters' resets by
        # `warnings.catch_warnings` elsewhere made each warning print again at every step on every rank (400 lines in
        # a 100-step, 2-rank run): nothing a user can act on
        warnings.filterwarnings("ignore", category=FutureWarning,
                                message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")

        # ---- models ------------------------------------------------------------------------------------------
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, **init_kwargs)
        model = peft_policy.wrap_policy(model, peft_config, args)
        if isinstance(ref_model, str):
            ref_model = AutoModelForCausalLM.from_pretrained(ref_model, **init_kwargs)
        elif ref_model is None and not peft_policy.is_peft_policy(model):  # LoRA: None, the base with adapters off
            ref_model = reference_model(model, self._source_model_path, init_kwargs)  # under ZeRO-3 loaded again
        if ref_model is not None:
            ref_model.eval().requires_grad_(False)
        self.timeline.mark("models_loaded")
        if args.disable_dropout:
            disable_dropout(model)
            if ref_model is not None:
                disable_dropout(ref_model)

        super().__init__(model=model, args=args, data_collator=lambda items: {"tickets": items},
                         train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                         compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                         preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        self.initial_policy = (provenance.initial_policy_record(self._source_model_path, model)
                               if self.accelerator.is_main_process else {})  # run_summary.json's `initial_policy`
        # a DeepSpeed engine under DeepSpeed; None for a LoRA policy (`logprobs.sequence_terms` switches adapters off)
        self.ref_model = prepare_frozen(ref_model, self.accelerator) if ref_model is not None else None
        self.scorer = RewardScorer(reward_funcs, args.reward_weights, reward_processing_classes,
                                   args.missing_eos_penalty, args.reward_failure, device=self.accelerator.device,
                                   prepare_model=lambda m: prepare_frozen(m, self.accelerator),
                                   shared_prefix=args.reward_shared_prefix)
        set_trl_attributes(self, args, model, processing_class)
        self.pipeline: RolloutPipeline | None = None
        self.add_callback(PipelineHooks(self))
        self._metrics: dict[str, list[float]] = collections.defaultdict(list)
        self.stats = self._metrics  # TRL's name: metric -> its values since the last log
        self._micro = 0
        self._step_batch: RolloutBatch | None = None
        self._kept_passes: list[tuple[list[ScoredGroup], dict]] = []  # num_iterations > 1: see `further_passes`
        self._loop_seconds = 0.0  # the training loop, periodic evaluations included (the summary takes them off)
        self.eval_seconds = 0.0  # periodic evaluations during training, rank 0 (`periodic_eval.py` adds to it)
        self._last_metrics: dict[str, float] = {}
        self.extra_logs: dict[str, float] = {}  # merged into the next log (e.g. periodic gold evaluation, rank 0)
        self.nonfinite = NonFiniteGuard(args.max_nonfinite_steps, self.accelerator)  # see learner/nonfinite.py
        self.timeline.mark("trainer_built")

    # ---- data: tickets in, pipeline batches out ----------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        steps_per_epoch = len(self.prompt_token_ids) // self.args.prompts_per_step
        if steps_per_epoch == 0:
            raise ConfigError(
                f"per_device_train_batch_size: one step needs {self.args.prompts_per_step} prompts "
                f"(batch x processes x gradient_accumulation_steps) but the dataset has {len(self.prompt_token_ids)}")
        # One ticket per micro-batch of the run when max_steps bounds it: the Trainer then ends a run resumed from its
        # final checkpoint without another step (transformers 5.19 would train one step past max_steps when the
        # resumed epoch still has tickets left). Which prompts a step trains is the PromptStream's business, not this.
        steps = self._total_steps() if self.args.max_steps > 0 else steps_per_epoch
        tickets = StepTickets(steps * self.args.gradient_accumulation_steps)
        return DataLoader(tickets, batch_size=1, collate_fn=self.data_collator)

    def _total_steps(self) -> int:
        return total_steps(self.args, len(self.prompt_token_ids))

    def sampling_settings(self) -> SamplingSettings:
        return SamplingSettings.from_config(self.args)

    def packing(self) -> dict:
        """How `logprobs.sequence_terms` packs this trainer's rows (one forward per model under DeepSpeed)."""
        return {"pad_id": self.processing_class.pad_token_id, "max_length": self.args.max_length,
                "device": self.accelerator.device, "shared_prefix": self.args.reference_shared_prefix,
                "split_forwards": self.splits_forwards(),
                "fused_temperature": self.reference_temperature() if self.fuses_reference() else None}

    def splits_forwards(self) -> bool:
        """`split_forwards` resolved: by default on CPU learners only (on an H100 the split step never clearly beat
        the padded one, 2,560 to 34,560 padded tokens a step: docs/performance.md, GPU evidence kit); never under
        DeepSpeed (True there is refused)."""
        if self.is_deepspeed_enabled:
            return False
        if self.args.split_forwards is None:
            return self.accelerator.device.type == "cpu"
        return self.args.split_forwards

    def reference_temperature(self) -> float:
        """The loss's reference temperature (`sequence_terms`' `temperature`; online DPO and Best-of-N: 1)."""
        return self.args.sampling_temperature

    def fuses_reference(self) -> bool:
        """Rank 0's scoring thread computes the reference log-probs, so the step skips its reference forward (an
        optional schedule's stage: `experimental/schedules.py`)."""
        return schedules.fuses_reference(self.args, ref_model=self.ref_model, deepspeed=self.is_deepspeed_enabled)

    def _schedule_stages(self) -> list:
        """The optional schedules' stages of rank 0's scoring thread (`experimental/schedules.scoring_stages`)."""
        p = {k: v for k, v in self.packing().items()
             if k in ("pad_id", "max_length", "device", "shared_prefix")}
        return schedules.scoring_stages(self.args, ref_model=self.ref_model, deepspeed=self.is_deepspeed_enabled,
                                        packing=p, temperature=self.reference_temperature())

    def micro_batch_groups(self) -> list[ScoredGroup]:
        """This rank's prompts of the current micro-batch, with their completions scored."""
        a = self.args
        step = self.state.global_step
        micro = self._micro
        self._micro = (micro + 1) % a.gradient_accumulation_steps
        batch = self.pipeline.micro_batch(step, micro, a.gradient_accumulation_steps)
        # the step's whole batch (train_while_generating: rank 0, from the last micro-batch); GRPO's "dapo" reads it
        self._step_batch = self.pipeline.trained_batch
        per = a.groups_per_micro_batch  # prompt groups (config/base.py)
        start = self.accelerator.process_index * per
        groups, metrics = score_rows(batch, range(start, start + per), self.scorer, self.processing_class,
                                     lambda pid: self.train_dataset[self.prompt_rows[pid]])
        metrics["queue/staleness_of_batch"] = float(step - batch.policy_version)
        for k, v in metrics.items():
            self._metrics[k].append(v)
        if self._micro == 0 and self.accelerator.is_main_process:  # the step's last micro-batch: its batch is whole
            self._record_trained_batch(step, self._step_batch)
        return groups

    def _record_trained_batch(self, step: int, batch: RolloutBatch) -> None:
        """The run's own record of what each step trained on (read by resume tests and audits)."""
        os.makedirs(self.args.output_dir, exist_ok=True)
        with open(os.path.join(self.args.output_dir, "trained_batches.jsonl"), "a") as f:
            record = {"step": step, "policy_version": batch.policy_version, "prompt_ids": batch.prompt_ids,
                      "sample_versions": batch.sample_versions()}
            record.update(self.pipeline.describe(batch))  # what the batch schedule adds (partial rollouts: groups)
            f.write(json.dumps(record) + "\n")

    # ---- the algorithm hook --------------------------------------------------------------------------------
    def compute_rollout_loss(self, model, groups: list[ScoredGroup],
                             kept: dict | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss of one micro-batch and its metrics. `kept`: with num_iterations > 1, what the step's first pass
        over these groups computed and the later passes reuse (the proximal log-probs, the advantages): empty in
        the first pass, where the algorithm fills it; None with one pass."""
        raise NotImplementedError

    def after_optimizer_step(self) -> None:
        """Called on every rank right after each policy optimizer step (every pass's, with num_iterations > 1),
        before the weight sync (PPO steps its critic here)."""

    def training_step(self, model, inputs, num_items_in_batch=None) -> torch.Tensor:
        model.train()
        groups = self.micro_batch_groups()
        kept = {} if self.passes > 1 else None
        if kept is not None:
            self._kept_passes.append((groups, kept))
        return self._backward(model, groups, kept)

    def _backward(self, model, groups: list[ScoredGroup], kept: dict | None) -> torch.Tensor:
        loss, metrics = self.compute_rollout_loss(model, groups, kept)
        self.nonfinite.note_loss(loss)
        for k, v in metrics.items():
            self._metrics[k].append(float(v))
        loss = loss / self.current_gradient_accumulation_steps
        kwargs = {"scale_wrt_gas": False} if self.accelerator.distributed_type == "DEEPSPEED" else {}
        self.accelerator.backward(loss, **kwargs)
        return loss.detach()

    def further_passes(self) -> None:
        """num_iterations > 1: after the step's first optimizer step (the Trainer's), passes 2.. over the same
        micro-batches, each one optimizer step of its own (gradients clipped as the Trainer's, a non-finite step
        skipped, `after_optimizer_step` after each), at the step's learning rate; the weights published afterwards
        are those after the last pass. Every rank runs the same passes (DDP averages each backward's gradients)."""
        kept, self._kept_passes = self._kept_passes, []
        if not kept or self.nonfinite.skipped_last:  # one pass, or the first pass's step was skipped (non-finite):
            return  # the batch is not trained further (a skipped step counts once, not once a pass)
        model = self.model_wrapped if self.model_wrapped is not None else self.model
        for _ in range(self.passes - 1):
            for groups, memo in kept:
                self._backward(model, groups, memo)
            grad_norm = None
            if self.args.max_grad_norm and self.args.max_grad_norm > 0:
                grad_norm = self.accelerator.clip_grad_norm_(model.parameters(), self.args.max_grad_norm)
            if not self.nonfinite.check_step(grad_norm, model, self.optimizer):
                self.optimizer.step()
            model.zero_grad(set_to_none=True)
            self.after_optimizer_step()

    def _get_grad_norm(self, model, grad_norm=None):
        """The Trainer's last call before `optimizer.step()`: a step with a non-finite loss or norm is skipped."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.nonfinite.check_step(grad_norm, model, self.optimizer)
        return grad_norm

    # ---- run: start generators, train, always shut down --------------------------------------------------
    def _identity(self) -> dict:
        return checkpointing.identity(self.accelerator.unwrap_model(self.model).config, len(self.prompt_token_ids),
                                      self.args.prompts_per_step, self.args.seed)

    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        self.timeline.mark("train_called")
        if self.accelerator.device.type == "cpu":
            torch.set_num_threads(self.args.cpu_learner_threads())
        elif self.accelerator.device.type == "cuda":  # process-wide: the scoring thread's models run here too
            torch.backends.cuda.enable_cudnn_sdp(self.args.cudnn_attention)
        try:  # until the pipeline takes them, generators spawned early are this method's to close
            checkpoint = checkpointing.resolve(resume_from_checkpoint, self.args.output_dir)
            restored = {"version": 0, "pending": [], "counters": {}}
            if checkpoint is not None:  # validated before any generator starts
                checkpointing.check_resume_is_safe(checkpoint, unpickles=self.is_deepspeed_enabled)
                restored = checkpointing.load_pipeline_state(checkpoint, self._identity())
            # LoRA: generators start from a merged copy, whatever the checkpoint
            lora = peft_policy.is_peft_policy(self.model)
            if checkpoint is not None and lora:
                peft_policy.load_adapter_checkpoint(self.model, checkpoint)
            if checkpoint is not None and not lora:
                model_dir, init_copy = checkpoint, None  # generators start from the checkpoint's weights
            else:
                # LoRA: the base's own directory while the adapters change nothing, else a merged copy
                source = self._source_model_path if not lora or peft_policy.adapters_are_identity(self.model) else None
                model_dir, init_copy = initial_model_dir(source, self.model, self.processing_class, self.accelerator,
                                                         self.args.shm_dir)
        except BaseException:
            self._close_early_pool()
            raise
        self.pipeline = RolloutPipeline(self.args, self.prompt_token_ids, model_dir, self.accelerator,
                                        self._total_steps(), self.sampling_settings(),
                                        self._pool_maker(model_dir, engine_kwargs(self.args, self.model)),
                                        score=self._fused_scoring(), budgets=self.prompt_budgets,
                                        batch_forming=schedules.batch_forming(self.args), rows=self.episode_rows)
        self._stop_signal = 0
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        for sig in previous:
            signal.signal(sig, self._on_signal)
        t0 = time.perf_counter()
        trained = False  # the loop ended normally: the pool then waits for the last weights' acknowledgements
        try:
            self.pipeline.start(restored["version"], restored["pending"], restored["counters"])
            if self.pipeline.records.start_seconds:  # the generators' own account: early ones, or started just now
                self.timeline.mark("generators_ready")
                self.timeline.mark("generators_spawned", self.pipeline.records.start_seconds, replace=True)
            t_loop = time.perf_counter()
            output = super().train(resume_from_checkpoint=checkpoint, trial=trial,
                                   ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            trained = True
            self._loop_seconds = time.perf_counter() - t_loop
        except (GeneratorFailed, StageTimeout, NonFiniteSteps) as exc:  # raised on every rank, between two steps
            self.pipeline.close(failed=True)  # the generators first: nothing more will come from them
            raise type(exc)(f"{exc}\n{self._checkpoint_after_failure()}") from exc
        finally:
            self.pipeline.close(failed=not trained)
            self._close_early_pool()  # never adopted (rank 0 resumed from the final checkpoint)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if init_copy is not None:  # rank 0's RAM copy of the initial weights
                init_copy.close()
        if self._stop_signal:
            raise KeyboardInterrupt(f"stopped by signal {self._stop_signal} after saving checkpoint-"
                                    f"{self.state.global_step} in {self.args.output_dir}")
        # every rank leaves train() once rank 0 has closed its generators (which waits, bounded, for their last
        # acknowledgements): a rank that ran ahead to the end of its script would tear down the process group under
        # a peer still inside the run (seen as an abort of rank 1 in a 2-rank run)
        self.accelerator.wait_for_everyone()
        self.run_summary = build_summary(self.pipeline, self.args, self.accelerator, self.state.global_step,
                                         time.perf_counter() - t0, self._loop_seconds, self.scorer.skipped,
                                         self._last_metrics, eval_seconds=self.eval_seconds)
        self.run_summary["startup"] = self.timeline.as_dict()
        self.run_summary["initial_policy"] = self.initial_policy
        if lora:
            self.run_summary["lora"] = peft_policy.memory_report(self.model, self.optimizer)
        if self.accelerator.is_main_process:
            print(format_summary(self.run_summary), flush=True)
            if lora:
                print(peft_policy.format_memory_report(self.run_summary["lora"]), flush=True)
            os.makedirs(self.args.output_dir, exist_ok=True)
            with open(os.path.join(self.args.output_dir, "run_summary.json"), "w") as f:
                json.dump(self.run_summary, f, indent=2)
        return output

    def _fused_scoring(self):
        """Rank 0's stages for each arriving part (`scoring/stage.py`): rewards, reference; None: off / DeepSpeed."""
        if not self.args.score_while_generating or self.is_deepspeed_enabled:
            return None
        return [("reward", lambda parts: score_parts(parts, self.scorer, self.processing_class,
                                                     lambda pid: self.train_dataset[self.prompt_rows[pid]])),
                *self._schedule_stages()]

    # ---- interruption and checkpoints ----------------------------------------------------------------------
    def _on_signal(self, signum, frame):
        """First SIGTERM/SIGINT: finish the current step, checkpoint, stop. Second: stop now.

        Ctrl-C reaches the whole process group, generators included: they ignore it (`generation/engine/worker.py`), and the
        pool is told the run is stopping, so a generator that dies from now on is not restarted (no engine start on
        the way out; the step fails with the usual checkpoint if it still needed that generator)."""
        if self._stop_signal:
            raise KeyboardInterrupt(f"received signal {signum} twice")
        self._stop_signal = signum
        if self.pipeline is not None:
            self.pipeline.begin_stop()

    def stop_requested(self) -> bool:
        flag = torch.tensor([float(self._stop_signal)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:  # every rank must stop at the same step, or collectives hang
            flag = self.accelerator.reduce(flag, reduction="sum")
        return bool(flag.item())

    def _checkpoint_after_failure(self) -> str:
        """The run failed for good between two optimizer steps (generator restarts exhausted, a stage timed out, or
        too many non-finite steps in a row, whose updates were skipped): save the learner as it stands, so the run resumes once the cause is fixed. Never overwrites a
        complete checkpoint. Returns the line that ends the error message."""
        step = self.state.global_step
        directory = os.path.join(self._get_output_dir(trial=None), f"checkpoint-{step}")
        if step == 0:
            return "No optimizer step was taken, so no checkpoint was saved."
        if checkpointing.is_complete(directory):
            return f"The last checkpoint, {directory}, holds this state; resume from it."
        try:
            self._save_checkpoint(self.model, trial=None)
        except Exception as exc:  # never hide the failure that brought us here
            return f"Saving {directory} failed too ({type(exc).__name__}: {exc})."
        return f"Saved {directory} at step {step}; resume with resume_from_checkpoint once the cause is fixed."

    def _save_checkpoint(self, model, trial):
        directory = os.path.join(self._get_output_dir(trial=trial), f"checkpoint-{self.state.global_step}")
        if self.args.should_save:
            checkpointing.begin_save(directory)  # rewriting a complete checkpoint: it is incomplete until the end
        super()._save_checkpoint(model, trial)
        if self.args.should_save:
            pending = self.pipeline.pending(self.state.global_step)
            checkpointing.save_pipeline_state(directory, self.state.global_step, pending,
                                              self.pipeline.counters(), self._identity())
            checkpointing.mark_complete(directory, self.state.global_step)

    # ---- logging -----------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._metrics:
            keys = sorted(self._metrics)
            values = torch.tensor([sum(self._metrics[k]) / len(self._metrics[k]) for k in keys],
                                  device=self.accelerator.device)
            if self.accelerator.num_processes > 1:
                values = self.accelerator.reduce(values, reduction="mean")
            means = dict(zip(keys, values.tolist()))
            logs = {**logs, **means}
            self._last_metrics = means
            self._metrics.clear()
        if self.pipeline is not None and "train_loss" not in logs:
            logs = {**logs, **self.pipeline.stats(), "learner/nonfinite_steps": float(self.nonfinite.total)}
        if self.extra_logs:
            logs, self.extra_logs = {**logs, **self.extra_logs}, {}
        super().log(logs, start_time)
        # transformers keeps every log in `state.log_history` (and writes it into every checkpoint): at one log per
        # step that grows by kilobytes a step, gigabytes over a long run (benchmarks/soak.py). The full record is
        # metrics.jsonl; memory and checkpoints keep the newest LOG_HISTORY_KEPT entries.
        del self.state.log_history[:-LOG_HISTORY_KEPT]
