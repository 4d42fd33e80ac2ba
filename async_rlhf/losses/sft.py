"""Supervised loss on sampled completions: Best-of-N SFT trains on the highest-scored of N samples.

The asynchronous RLHF paper uses Best-of-2 as a baseline: sample two completions, keep the one the reward model
prefers, and minimise its negative log-likelihood. The caller picks the sample; this file only averages.
"""

from __future__ import annotations

import torch
from torch import Tensor

from async_rlhf.losses.off_policy import check_same_shape, masked_mean


def best_of_n_nll(logps: Tensor, mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean negative log-likelihood per completion token: −Σ mask·logps / Σ mask.

    Args:
        logps: [B, T] log-probs of the kept completions' tokens under the policy (carries the gradient).
        mask: [B, T] 1 on completion tokens (prompt and padding excluded).

    Returns (loss, metrics): loss and num_tokens (Σ mask), detached scalars. The mean is over all tokens of the
    batch, so longer completions weigh more; an all-zero mask gives loss 0.
    """
    check_same_shape(logps=logps, mask=mask)
    fmask = mask.to(logps.dtype)
    loss = -masked_mean(logps, fmask)
    with torch.no_grad():
        metrics = {"loss": loss.detach(), "num_tokens": fmask.sum()}
    return loss, metrics
