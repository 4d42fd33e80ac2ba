"""The algorithms' configurations: `AsyncRLConfig` (config/base.py) plus each learner's own fields, with TRL 1.16's names
and defaults (where a CPU-sized default makes more sense, the field's help says so). Validated in `__post_init__` like
the shared fields, with a message naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rlhf.config.base import AsyncRLConfig, _require, check_types


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
# 'auto' picks TIS up to this many steps of token staleness and the clipped ratio beyond: on the sorting task
# (evals/results/sorting_staleness, three seeds) TIS was level with the clipped ratio at 1 and 3 steps, behind it at 7
# and collapsing at 15.
TIS_MAX_STALENESS = 3


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
                  "min(pi_prox/mu, is_cap), the ratio against pi_prox. 'decoupled': decoupled PPO (Hilton et al. "
                  "2021), weight pi_prox/mu, tokens above is_cap dropped. 'masked': masked IS with two-sided bounds "
                  "(IcePop-style), weight pi_prox/mu, tokens outside [is_floor, is_cap] dropped. 'auto' (default): "
                  "'none' when no token can be stale (max_staleness 0: parity with synchronous training, "
                  "tests/integration/test_sync_parity.py); 'tis' for RLOO, PPO and GRPO when tokens can be 1 to "
                  "TIS_MAX_STALENESS (3) steps stale: plain PPO one step stale failed where TIS trained (marin "
                  "#8955: GSM8k 2/128 against 98/128, Qwen3-0.6B), PipelineRL and TRL's vLLM correction ship "
                  "token-level TIS, and at N = 4 it ended highest on our toy task for RLOO and PPO (one seed, "
                  "evals/results/off_policy_defaults) and level with 'none' at N = 2 and 4 on the sorting task (three "
                  "seeds, evals/results/sorting_staleness); 'none' beyond: on the sorting task TIS was behind at "
                  "N = 8 (gold reward 1.37-1.46 against 1.46-1.54) and at N = 16 collapsed RLOO and PPO below the "
                  "SFT policy (0.85-0.93 against 1.05; 'none' 1.42-1.46), since "
                  "its weights keep pushing tokens the policy has already moved past, where the ratio clipped "
                  "against mu stops them (an unclipped loss also diverged at 3 steps in the Tinker cookbook, #822). "
                  "Online DPO takes no correction: its loss has no importance ratio. The resolved value is what the "
                  "run records."},
    )
    is_cap: float = field(default=2.0, metadata={"help": "Upper bound of the importance weights ('tis', "
                                                         "'decoupled', 'masked')."})
    is_floor: float = field(default=0.5, metadata={"help": "Lower bound of the importance weights ('masked'): "
                                                           "tokens with pi_prox/mu below it are dropped."})

    stale_correction = "tis"  # what 'auto' resolves to when tokens can be 1 to TIS_MAX_STALENESS steps stale

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
        super().__post_init__()
        if self.off_policy_correction == "auto":  # after the shared checks: max_staleness may come from N
            stale = self.max_token_staleness()
            self.off_policy_correction = self.stale_correction if 1 <= stale <= TIS_MAX_STALENESS else "none"
        super().__post_init__()


@dataclass
class AsyncRLOOConfig(AsyncPolicyGradientConfig):
    """RLOO (Ahmadian et al. 2024) on the asynchronous pipeline; k = num_generations samples per prompt."""

    normalize_advantages: bool = field(default=False, metadata={"help": "Whiten advantages over the batch."})


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
class AsyncGRPOConfig(AsyncPolicyGradientConfig):
    """GRPO (Shao et al. 2024) on the asynchronous pipeline, with TRL 1.16 GRPOConfig's names and defaults for the
    loss (`loss_type` "dapo", `beta` 0, `scale_rewards` "group", `num_generations` 8). The ratio's denominator and
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
    mask_truncated_completions: bool = field(default=False, metadata={"help": "Leave completions that hit "
                                                                              "max_completion_length out of the "
                                                                              "loss (DAPO)."})
    num_iterations: int = field(default=1, metadata={"help": "Updates per batch; only 1 (each batch trains one "
                                                             "optimizer step; staleness is max_staleness's)."})
    sapo_temperature_pos: float = field(default=1.0, metadata={"help": "'sapo': gate temperature, A > 0."})
    sapo_temperature_neg: float = field(default=1.05, metadata={"help": "'sapo': gate temperature, A <= 0."})

    def __post_init__(self):
        from async_rlhf.losses.grpo import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, SCALE_REWARDS

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
        _require(self.num_iterations == 1, "num_iterations",
                 f"only 1 is supported (one optimizer step per batch), got {self.num_iterations}")
        _require(self.sapo_temperature_pos > 0 and self.sapo_temperature_neg > 0, "sapo_temperature_pos",
                 f"sapo temperatures must be > 0, got {self.sapo_temperature_pos}, {self.sapo_temperature_neg}")
        super().__post_init__()
