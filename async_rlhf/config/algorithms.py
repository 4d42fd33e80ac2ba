"""The algorithms' configurations: `AsyncRLConfig` (config/base.py) plus each learner's own fields, with TRL 1.16's names
and defaults (where a CPU-sized default makes more sense, the field's help says so). Validated in `__post_init__` like
the shared fields, with a message naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rlhf.config.base import AsyncRLConfig, check_types
from async_rlhf.config.checks import require as _require
from async_rlhf.errors import ConfigError


@dataclass
class AsyncOnlineDPOConfig(AsyncRLConfig):
    """Online DPO (Guo et al. 2024) on the asynchronous pipeline. Field names follow TRL's OnlineDPOConfig."""

    learning_rate: float = field(default=5e-7, metadata={"help": "AdamW learning rate (TRL default)."})
    beta: list[float] = field(
        default_factory=lambda: [0.1],
        metadata={"help": "KL strength. A list gives one value per epoch (TRL), the last one repeating."},
    )
    loss_type: str = field(default="sigmoid", metadata={"help": "'sigmoid' (DPO) or 'ipo'."})

    def __post_init__(self):
        check_types(self)
        betas = self.beta if isinstance(self.beta, list) else [self.beta]
        _require(len(betas) >= 1 and all(b > 0 for b in betas), "beta", f"must be > 0, got {self.beta}")
        self.beta = betas[0] if len(betas) == 1 else betas
        _require(self.loss_type in ("sigmoid", "ipo"), "loss_type", f"{self.loss_type!r} is not 'sigmoid' or 'ipo'")
        super().__post_init__()

    def beta_at(self, epoch: float) -> float:
        if isinstance(self.beta, list):
            return self.beta[min(int(epoch), len(self.beta) - 1)]
        return self.beta


OFF_POLICY_CORRECTIONS = ("auto", "none", "tis", "decoupled", "masked")

@dataclass
class AsyncPolicyGradientConfig(AsyncRLConfig):
    """Fields shared by the policy-gradient learners (RLOO, PPO, GRPO). Names follow TRL's RLOOConfig."""

    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL RLOO default)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; log-probs use the same."})
    beta: float = field(default=0.05, metadata={"help": "KL coefficient: reward = score - beta * sum(log pi - "
                                                        "log pi_ref)."})
    epsilon: float = field(default=0.2, metadata={"help": "PPO clip range of the probability ratio."})
    max_completion_length: int | None = field(default=None, metadata={"help": "TRL's name for max_new_tokens; "
                                                                               "overrides it when set."})
    off_policy_correction: str = field(
        default="auto",
        metadata={"help": "Stale-sample handling (mu: the generator's behaviour log-probs; pi_prox: the learner's "
                  "weights before the update). 'none': the PPO ratio pi/mu, clipped (plain PPO on whatever "
                  "arrived). 'tis': token-level truncated importance sampling, each token weighted by "
                  "min(pi_prox/mu, is_cap), the ratio against pi_prox. 'decoupled': weight pi_prox/mu, tokens above "
                  "is_cap dropped, the ratio against pi_prox. 'masked': as 'decoupled', tokens outside "
                  "[is_floor, is_cap] dropped (IcePop-style). With one pass per batch (num_iterations 1) pi_prox is "
                  "the policy being trained, so 'tis', 'decoupled' and 'masked' clip nothing (clipfrac 0 in every "
                  "'tis' run): they are importance-weighted policy gradients with no trust region. num_iterations > "
                  "1 gives them one: passes after the first clip pi/pi_prox, which with 'decoupled' is AReaL's "
                  "decoupled PPO (Hilton et al. 2021). 'auto' (default): 'none', the clipped ratio, for every "
                  "algorithm and staleness, because in our records no correction beat it (sorting task, five seeds, "
                  "final gold reward, correction minus none, Welch 95 percent intervals: tis at N = 4 / 8 / 16: "
                  "RLOO -0.054 [-0.131, "
                  "+0.023] / -0.103 [-0.198, -0.007] / -0.395 [-0.549, -0.241], PPO -0.041 [-0.100, +0.018] / "
                  "-0.085 [-0.183, +0.014] / -0.591 [-0.724, -0.459], GRPO -0.109 [-0.190, -0.028] at N = 4 and "
                  "-0.353 [-0.479, -0.228] at 16; decoupled at two passes, N = 1 / 8: RLOO -0.003 [-0.093, +0.087] / "
                  "-0.349 [-0.456, -0.242], PPO +0.018 [-0.027, +0.063] / -0.403 [-0.529, -0.277]; tables: "
                  "evals/results/sorting_corrections_seeds45/NOTES.md, evals/results/sorting_grpo_tis/NOTES.md). "
                  "'masked' has no multi-seed record. Elsewhere TIS trained where plain PPO one step stale failed "
                  "(marin #8955, GSM8k, Qwen3-0.6B): set 'tis' to try it. Online DPO takes no correction: its loss "
                  "has no importance ratio. The resolved value is what the run records."},
    )
    is_cap: float = field(default=2.0, metadata={"help": "Upper bound of the importance weights ('tis', "
                                                         "'decoupled', 'masked')."})
    is_floor: float = field(default=0.5, metadata={"help": "Lower bound of the importance weights ('masked'): "
                                                           "tokens with pi_prox/mu below it are dropped."})
    num_iterations: int = field(
        default=1,
        metadata={"help": "Optimizer passes over each step's batch (TRL's name; its mu in GRPO). Pass 1 is the "
                  "usual step; passes 2.. reuse the batch, its advantages and the proximal policy pi_prox (the "
                  "learner's log-probs before the step's first pass, AReaL's decoupled PPO), so the clipped ratio "
                  "pi/pi_prox (with 'tis', 'decoupled', 'masked') or pi/mu ('none') can bind. All passes are one "
                  "step here: one batch, one weight version, one learning-rate value; max_steps counts batches "
                  "(TRL counts each pass as a step). Not under DeepSpeed."},
    )

    def __post_init__(self):
        check_types(self)
        if self.max_completion_length is not None:
            self.max_new_tokens = self.max_completion_length
        _require(self.beta >= 0, "beta", f"must be >= 0, got {self.beta}")
        _require(0 < self.epsilon < 1, "epsilon", f"must be in (0, 1), got {self.epsilon}")
        _require(self.off_policy_correction in OFF_POLICY_CORRECTIONS, "off_policy_correction",
                 f"{self.off_policy_correction!r} is not one of {OFF_POLICY_CORRECTIONS}")
        _require(self.is_cap > 1, "is_cap", f"must be > 1, got {self.is_cap}")
        _require(0 <= self.is_floor < 1, "is_floor", f"must be in [0, 1), got {self.is_floor}")
        _require(self.num_iterations >= 1, "num_iterations", f"must be >= 1, got {self.num_iterations}")
        if self.off_policy_correction == "auto":  # the clipped ratio: nothing beat it in our records (help above)
            self.off_policy_correction = "none"
        super().__post_init__()


@dataclass
class AsyncGroupRLConfig(AsyncPolicyGradientConfig):
    """What TRL 1.16's `RLOOConfig` and `GRPOConfig` share: batch sizes counted in completions, TRL's defaults, and
    every field of theirs accepted (config/trl_fields.py: what each becomes here, or why it is a no-op).

    Batches, as TRL counts them: `per_device_train_batch_size` completions per rank per micro-batch; a step trains
    per_device_train_batch_size x processes x gradient_accumulation_steps completions, that divided by
    `num_generations` prompts (`prompts_per_step`). TRL's `generation_batch_size` / `steps_per_generation` are derived
    and checked with TRL's rules and messages. Here a micro-batch holds whole prompt groups, so
    per_device_train_batch_size must be a multiple of num_generations (TRL only needs generation_batch_size to be)."""

    max_new_tokens: int | None = field(default=None, metadata={"help": "Our name for max_completion_length "
                                                                      "(which wins where both are set)."})
    max_completion_length: int | None = field(default=None, metadata={
        "help": "Maximum tokens generated per completion; None: max_new_tokens if set, else 512 (TRL's default)."})
    max_length: int | None = field(default=None, metadata={
        "help": "Prompt + completion tokens in the learner's forward (TRL has no such field and does not cut "
                "prompts; prompts longer than max_length - max_completion_length are skipped here, counted and "
                "logged). None: 512, or 2 x max_completion_length when that is more; the trainer lowers a default "
                "that the policy's max_position_embeddings cannot hold."})
    generation_batch_size: int | None = field(default=None, metadata={
        "help": "TRL: completions per generation batch; None: per_device_train_batch_size x processes x "
                "steps_per_generation. Set at most one of it and steps_per_generation."})
    steps_per_generation: int | None = field(default=None, metadata={
        "help": "TRL: micro-batches per generation batch (None: gradient_accumulation_steps). A multiple m > 1 of "
                "gradient_accumulation_steps samples m steps' completions with one policy: num_mini_batches m "
                "(sync_every m, max_staleness m - 1); a divisor of it changes nothing here; anything else is refused "
                "(a generation batch here never straddles two optimizer steps)."})
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Leave completions that hit "
                                                                              "max_completion_length out of the "
                                                                              "loss (DAPO)."})
    vllm_max_model_length: int | None = field(default=None, metadata={"help": "TRL's name for vllm_max_model_len "
                                                                              "(sets it when given)."})
    num_generations_eval: int | None = field(default=None, metadata={"help": "TRL: no-op (evaluation here is the "
                                                                             "task's: tasks/evaluation.py)."})
    shuffle_dataset: bool = field(default=True, metadata={"help": "TRL: no-op unless True; prompts are always drawn "
                                                                  "in a seeded permutation per epoch."})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "TRL: 'auto' (its default) is None "
                                                                          "off Neuron, as TRL holds it after its "
                                                                          "checks; an int is a no-op here."})
    max_tool_calling_iterations: int | None = field(default=None, metadata={
        "help": "TRL: with tools or environment_factory, the most rounds of tool calls in one episode (None: no "
                "limit); an episode that reaches it ends on its last call."})
    tool_timeout: float = field(default=60.0, metadata={
        "help": "With tools or environment_factory: seconds one tool call may take; a call past it answers the model "
                "an error naming the limit and is counted (tools/failure_frequency, "
                "episodes/tool_timeout_frequency)."})
    chat_template_kwargs: dict | str | None = field(default=None, metadata={
        "help": "TRL: extra arguments of the chat template; applied to multi-turn episodes (tools or "
                "environment_factory); single-turn prompts are rendered with the template as is."})
    router_aux_loss_coef: float | None = field(default=None, metadata={"help": "TRL: no-op (no MoE aux loss)."})
    sync_ref_model: bool = field(default=False, metadata={"help": "TRL: every ref_model_sync_steps steps the "
                                                                  "reference becomes alpha x policy + (1 - alpha) x "
                                                                  "reference (TR-DPO); not with LoRA, DeepSpeed or "
                                                                  "a fused reference."})
    ref_model_mixup_alpha: float = field(default=0.6, metadata={"help": "TRL: alpha of sync_ref_model."})
    ref_model_sync_steps: int = field(default=512, metadata={"help": "TRL: steps between reference syncs."})
    log_completions: bool = field(default=False, metadata={"help": "TRL: no-op (every trained batch is in "
                                                                   "trained_batches.jsonl)."})
    log_multimodal: bool = field(default=True, metadata={"help": "TRL: no-op (text policies only)."})
    num_completions_to_print: int | None = field(default=None, metadata={"help": "TRL: no-op."})
    log_unique_prompts: bool = field(default=False, metadata={"help": "TRL: no-op."})
    use_transformers_continuous_batching: bool = field(default=False, metadata={"help": "TRL: True sets "
                                                                                        "continuous_batching."})
    transformers_continuous_batching_config: dict | str | None = field(
        default=None, metadata={"help": "TRL: with use_transformers_continuous_batching, sets "
                                        "continuous_batching_config."})
    use_transformers_paged: bool = field(default=False, metadata={"help": "TRL (deprecated): True sets "
                                                                          "use_transformers_continuous_batching."})

    counts_completions = True  # class constant: per_device_train_batch_size counts completions (TRL), not prompts

    def __post_init__(self):
        from async_rlhf.config.trl_fields import apply_group_fields, pad_multiple

        self.pad_to_multiple_of = pad_multiple(self.pad_to_multiple_of)  # before the type check: TRL takes 'auto'
        check_types(self)
        apply_group_fields(self)  # lengths, TRL's batch rules, field mappings and the no-op warning
        super().__post_init__()

    @property
    def groups_per_micro_batch(self) -> int:
        """Prompt groups per rank per micro-batch: per_device_train_batch_size completions / num_generations."""
        return self.per_device_train_batch_size // self.num_generations


@dataclass
class AsyncRLOOConfig(AsyncGroupRLConfig):
    """RLOO (Ahmadian et al. 2024) on the asynchronous pipeline; k = num_generations samples per prompt. Fields and
    defaults follow TRL 1.16's RLOOConfig (num_generations 2, beta 0.05); batch sizes count completions."""

    normalize_advantages: bool = field(default=False, metadata={"help": "Whiten advantages over the batch."})
    reward_clip_range: list[float] | None = field(default=None, metadata={
        "help": "Clamp each completion's combined reward to [low, high] before the KL penalty (TRL); None: off."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip bound of the ratio (default: "
                                                                       "epsilon)."})

    def __post_init__(self):
        from async_rlhf.config.trl_fields import pad_multiple

        self.pad_to_multiple_of = pad_multiple(self.pad_to_multiple_of)  # before the type check: TRL takes 'auto'
        check_types(self)
        if self.reward_clip_range is not None:
            _require(len(self.reward_clip_range) == 2 and self.reward_clip_range[0] <= self.reward_clip_range[1],
                     "reward_clip_range", f"must be [low, high] with low <= high, got {self.reward_clip_range}")
        _require(self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high",
                 f"must be > 0, got {self.epsilon_high}")
        super().__post_init__()


@dataclass
class AsyncPPOConfig(AsyncPolicyGradientConfig):
    """PPO with a learned critic and GAE, as TRL's former PPOv2 (which the paper used)."""

    num_generations: int = field(default=1, metadata={"help": "Completions per prompt (PPO needs only 1)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value update."})
    whiten_advantages: bool = field(default=True, metadata={"help": "Whiten advantages over the batch."})

    min_generations = 1  # a critic is the baseline: one completion per prompt suffices


@dataclass
class AsyncBestOfNConfig(AsyncRLConfig):
    """Best-of-N SFT (the paper's Best-of-2): negative log-likelihood on the highest-scored of N samples."""

    learning_rate: float = field(default=1e-5, metadata={"help": "AdamW learning rate."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature."})


@dataclass
class AsyncGRPOConfig(AsyncGroupRLConfig):
    """GRPO (Shao et al. 2024) on the asynchronous pipeline: every field of TRL 1.16's GRPOConfig, with its defaults
    (`loss_type` "dapo", `beta` 0, `scale_rewards` "group", `num_generations` 8) and its batch semantics
    (`AsyncGroupRLConfig`). The ratio's denominator and
    the stale-sample handling are `off_policy_correction`'s, as for RLOO and PPO. The reference model is still
    loaded and run at beta 0 (for the objective/kl metric every learner logs)."""

    beta: float = field(default=0.0, metadata={"help": "Weight of the per-token k3 KL(pi || pi_ref) in the loss "
                                                       "(TRL default 0)."})
    num_generations: int = field(default=8, metadata={"help": "Completions per prompt: the group (>= 2)."})
    loss_type: str = field(default="dapo", metadata={"help": "How token terms are summed: 'grpo' (per-sequence "
                                                             "mean, then mean), 'bnpo' (micro-batch token mean), "
                                                             "'dr_grpo' (sum / (B * max_completion_length)), 'dapo' "
                                                             "(sum / tokens of the whole step), 'cispo', 'sapo'."})
    scale_rewards: str = field(default="group", metadata={"help": "Divide advantages by the reward std of the "
                                                                  "'group', of the 'batch' (this micro-batch), or "
                                                                  "'none' (also true / false)."})
    epsilon_high: float | None = field(default=None, metadata={"help": "Upper clip bound (default: epsilon; DAPO "
                                                                       "uses 0.28). 'cispo': the weight's cap."})
    delta: float | None = field(default=None, metadata={"help": "Two-sided clipping: cap of the unclipped ratio "
                                                                "(INTELLECT-2); None: off."})
    importance_sampling_level: str = field(default="token", metadata={"help": "'token' ratios or one 'sequence' "
                                                                              "ratio (GSPO)."})
    use_bias_correction_kl: bool = field(default=True, metadata={"help": "Multiply the KL term by the ratio."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "'sapo': gate temperature, A > 0."})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "'sapo': gate temperature, A <= 0."})
    multi_objective_aggregation: str = field(default="sum_then_normalize", metadata={
        "help": "How several reward functions make one advantage: 'sum_then_normalize' (TRL's default: the weighted "
                "sum, then the group normalisation); 'normalize_then_sum' is refused (not built here)."})
    # ---- TRL 1.16 GRPOConfig fields with nothing to act on here (named in one warning when not TRL's default;
    # config/trl_fields.py says why for each) -------------------------------------------------------------------
    cast_lm_head_to_fp32: bool = field(default=False, metadata={"help": "TRL: no-op."})
    vespo_k_pos: float = field(default=2.0, metadata={"help": "TRL ('vespo' loss): no-op, that loss is not built."})
    vespo_lambda_pos: float = field(default=3.0, metadata={"help": "TRL ('vespo' loss): no-op."})
    vespo_k_neg: float = field(default=3.0, metadata={"help": "TRL ('vespo' loss): no-op."})
    vespo_lambda_neg: float = field(default=2.0, metadata={"help": "TRL ('vespo' loss): no-op."})
    top_entropy_quantile: float = field(default=1.0, metadata={"help": "TRL: no-op unless 1.0 (every token "
                                                                       "trains)."})
    entropy_coef: float = field(default=0.0, metadata={"help": "TRL: no-op unless 0 (no entropy bonus)."})
    use_adaptive_entropy: bool = field(default=False, metadata={"help": "TRL: no-op."})
    entropy_coef_min: float = field(default=0.0, metadata={"help": "TRL: no-op."})
    entropy_coef_max: float = field(default=1.0, metadata={"help": "TRL: no-op."})
    entropy_coef_delta: float = field(default=0.005, metadata={"help": "TRL: no-op."})
    entropy_target: float = field(default=0.2, metadata={"help": "TRL: no-op."})
    vllm_importance_sampling_correction: bool = field(default=True, metadata={
        "help": "TRL: its correction of the generator/learner mismatch; here off_policy_correction does that job."})
    vllm_importance_sampling_mode: str = field(default="sequence_mask", metadata={"help": "TRL: no-op "
                                                                                          "(off_policy_correction)."})
    vllm_importance_sampling_clip_max: float | None = field(default=3.0, metadata={"help": "TRL: no-op (is_cap)."})
    vllm_importance_sampling_clip_min: float | None = field(default=None, metadata={"help": "TRL: no-op "
                                                                                            "(is_floor)."})
    vllm_importance_sampling_cap: float | None = field(default=None, metadata={"help": "TRL (deprecated): sets "
                                                                                      "..._clip_max."})
    off_policy_mask_threshold: float | None = field(default=None, metadata={"help": "TRL: no-op "
                                                                                    "(off_policy_correction)."})
    log_completions_hub_repo: str | None = field(default=None, metadata={"help": "TRL: no-op (needs "
                                                                                "log_completions)."})

    def __post_init__(self):
        from async_rlhf.losses.grpo import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS

        from async_rlhf.config.trl_fields import pad_multiple

        self.pad_to_multiple_of = pad_multiple(self.pad_to_multiple_of)  # before the type check: TRL takes 'auto'
        if isinstance(self.scale_rewards, str):  # flags and YAML may spell TRL's booleans as text
            self.scale_rewards = {"true": True, "false": False}.get(self.scale_rewards.lower(), self.scale_rewards)
        self.scale_rewards = {True: "group", False: "none"}.get(self.scale_rewards, self.scale_rewards)
        check_types(self)
        _require(self.loss_type in LOSS_TYPES, "loss_type", f"{self.loss_type!r} is not one of {LOSS_TYPES}")
        _require(self.scale_rewards in SCALE_REWARDS, "scale_rewards",
                 f"{self.scale_rewards!r} is not one of {SCALE_REWARDS} (or true / false)")
        _require(self.importance_sampling_level in IMPORTANCE_SAMPLING_LEVELS, "importance_sampling_level",
                 f"{self.importance_sampling_level!r} is not one of {IMPORTANCE_SAMPLING_LEVELS}")
        _require(self.epsilon_high is None or self.epsilon_high > 0, "epsilon_high",
                 f"must be > 0, got {self.epsilon_high}")
        _require(self.delta is None or self.delta > 1, "delta", f"must be > 1 (a cap on the ratio), got {self.delta}")
        _require(self.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
                 "multi_objective_aggregation", f"Invalid multi_objective_aggregation: "
                 f"{self.multi_objective_aggregation}. Must be 'sum_then_normalize' or 'normalize_then_sum'.")
        _require(self.multi_objective_aggregation == "sum_then_normalize", "multi_objective_aggregation",
                 "'normalize_then_sum' is not built here yet; use 'sum_then_normalize' (TRL's default)")
        if self.log_completions_hub_repo is not None and not self.log_completions:  # TRL's check and message
            raise ConfigError("log_completions_hub_repo is set, but log_completions is False. Enable log_completions "
                              "to upload completions to the Hub, or unset log_completions_hub_repo.")
        if self.vllm_importance_sampling_cap is not None:
            self.vllm_importance_sampling_clip_max = self.vllm_importance_sampling_cap
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        if lo is not None and hi is not None and lo >= hi:
            raise ConfigError(f"vllm_importance_sampling_clip_min ({lo}) must be less than "
                              f"vllm_importance_sampling_clip_max ({hi}).")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode in
                ("token_truncate", "sequence_truncate") and lo is None and hi is None):
            raise ConfigError("At least one of `vllm_importance_sampling_clip_min` or "
                              "`vllm_importance_sampling_clip_max` must be set when `vllm_importance_sampling_mode` "
                              "is a `*_truncate` mode.")
        _require(self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0, "sapo_temperature_pos",
                 f"sapo temperatures must be > 0, got {self.sapo_temperature_pos}, {self.sapo_temperature_neg}")
        super().__post_init__()
