"""DPO and IPO: preference losses on sequence log-probs of a chosen and a rejected completion.

Online DPO (Guo et al. 2024) samples two completions per prompt, lets a reward model pick the chosen one, and
applies this loss; it is the loss of the asynchronous RLHF paper's main experiments (Noukhovitch et al. 2024).

Every input is [B]: the sum over completion tokens of per-token log-probs (see `sft.py` for the token-level
convention). Metric names match TRL's online DPO logs; the caller adds the stage prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from async_rlhf.losses.off_policy import check_same_shape

DPO_LOSS_TYPES = ("sigmoid", "ipo")


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float,
    loss_type: str = "sigmoid",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean DPO or IPO loss over a batch of preference pairs.

    With h = (log π(y_c) − log π_ref(y_c)) − (log π(y_r) − log π_ref(y_r)):
        "sigmoid": −log σ(β·h)               DPO, Rafailov et al. 2023 (arXiv:2305.18290), eq. 7.
        "ipo":     (h − 1/(2β))²             IPO, Azar et al. 2023 (arXiv:2310.12036v2), eq. 17, as TRL
                                             implements it. (TRL's offline DPOTrainer feeds IPO the per-token
                                             mean log-prob; pass length-normalised log-probs to match that.)

    Args:
        policy_chosen_logps, policy_rejected_logps: [B] sequence log-probs under the policy (carry the gradient).
        ref_chosen_logps, ref_rejected_logps: [B] the same under the frozen reference model (detached inside).
        beta: β > 0, the strength of the KL regularisation.
        loss_type: "sigmoid" or "ipo".

    Returns (loss, metrics), metrics detached scalars (means over the batch):
        rewards/chosen, rewards/rejected: β·(log π − log π_ref), the implicit rewards;
        rewards/margins: chosen − rejected; rewards/accuracies: fraction with chosen > rejected (strictly);
        logps/chosen, logps/rejected: policy sequence log-probs; loss.
    """
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; valid: {', '.join(DPO_LOSS_TYPES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    check_same_shape(
        policy_chosen_logps=policy_chosen_logps,
        policy_rejected_logps=policy_rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
    )
    if policy_chosen_logps.dim() != 1:
        raise ValueError(f"sequence log-probs must be [B], got shape {tuple(policy_chosen_logps.shape)}")

    chosen_logratios = policy_chosen_logps - ref_chosen_logps.detach()
    rejected_logratios = policy_rejected_logps - ref_rejected_logps.detach()
    logits = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * logits)
    else:
        losses = (logits - 1.0 / (2.0 * beta)) ** 2
    loss = losses.mean()

    with torch.no_grad():
        chosen_rewards = beta * chosen_logratios.detach()
        rejected_rewards = beta * rejected_logratios.detach()
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).to(loss.dtype).mean(),
            "logps/chosen": policy_chosen_logps.detach().mean(),
            "logps/rejected": policy_rejected_logps.detach().mean(),
            "loss": loss.detach(),
        }
    return loss, metrics
