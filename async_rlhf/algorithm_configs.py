"""The algorithms' configurations: `AsyncRLConfig` (config.py) plus each learner's own fields, with TRL 1.16's names
and defaults (where a CPU-sized default makes more sense, the field's help says so). Validated in `__post_init__` like
the shared fields, with a message naming the field."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_rlhf.config import AsyncRLConfig, _require, check_types


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


OFF_POLICY_CORRECTIONS = ("none", "tis", "decoupled")


@dataclass
class AsyncPolicyGradientConfig(AsyncRLConfig):
    """Fields shared by the policy-gradient learners (RLOO, PPO). Names follow TRL's RLOOConfig."""

    learning_rate: float = field(default=1e-6, metadata={"help": "AdamW learning rate (TRL RLOO default)."})
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature; log-probs use the same."})
    beta: float = field(default=0.05, metadata={"help": "KL coefficient: reward = score - beta * sum(log pi - "
                                                        "log pi_ref)."})
    epsilon: float = field(default=0.2, metadata={"help": "PPO clip range of the probability ratio."})
    max_completion_length: int | None = field(default=None, metadata={"help": "TRL's name for max_new_tokens; "
                                                                               "overrides it when set."})
    off_policy_correction: str = field(
        default="none",
        metadata={"help": "Stale-sample handling: 'none' (clip the ratio against the generator's behaviour "
                  "log-probs), 'tis' (truncated importance weights min(pi_prox/mu, is_cap) with the ratio "
                  "against the proximal policy = learner weights before the update) or 'decoupled' (the "
                  "decoupled PPO objective, Hilton et al. 2021; tokens with weight above is_cap are dropped)."},
    )
    is_cap: float = field(default=2.0, metadata={"help": "Cap of the importance weights ('tis', 'decoupled')."})

    def __post_init__(self):
        check_types(self)
        if self.max_completion_length is not None:
            self.max_new_tokens = self.max_completion_length
        _require(self.beta >= 0, "beta", f"must be >= 0, got {self.beta}")
        _require(0 < self.epsilon < 1, "epsilon", f"must be in (0, 1), got {self.epsilon}")
        _require(self.off_policy_correction in OFF_POLICY_CORRECTIONS, "off_policy_correction",
                 f"{self.off_policy_correction!r} is not one of {OFF_POLICY_CORRECTIONS}")
        _require(self.is_cap > 1, "is_cap", f"must be > 1, got {self.is_cap}")
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
