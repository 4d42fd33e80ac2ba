"""Hand-worked tests for the off-policy weights of `losses/off_policy.py` (masked IS with two-sided bounds, the
effective sample size, `off_policy_weights`) and for the "masked" mode of the PPO / GRPO losses: three-element
tensors, the expected arithmetic in comments."""

import math

import pytest
import torch

from async_rlhf.losses import (
    grpo_loss,
    importance_ess,
    log_ratio_stats,
    masked_importance_weights,
    off_policy_weights,
    ppo_policy_loss,
    rloo_loss,
)

LN3, LN4 = math.log(3.0), math.log(4.0)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32), torch.tensor(expected), atol=atol,
                               rtol=0)


def raw_three():
    """log π − log μ = [0, ln 3, −ln 4]: raw weights w = π/μ = [1, 3, 0.25]."""
    learner = t([-1.0, -1.0, -1.0])
    return learner, learner - t([0.0, LN3, -LN4])


def test_masked_weights_two_sided_one_sided_and_wide():
    learner, behaviour = raw_three()
    # [0.5, 2]: 3 > 2 and 0.25 < 0.5 are dropped -> [1, 0, 0]; 2 of 3 tokens out of bounds
    w, frac = masked_importance_weights(learner, behaviour, floor=0.5, cap=2.0)
    close(w, [[1.0, 0.0, 0.0]])
    close(frac, 2 / 3)
    # floor 0 (one-sided, MIS): only 3 > 2 is dropped -> [1, 0, 0.25]
    w, frac = masked_importance_weights(learner, behaviour, floor=0.0, cap=2.0)
    close(w, [[1.0, 0.0, 0.25]])
    close(frac, 1 / 3)
    # [0.2, 4]: everything inside, weights kept as they are (not truncated, not renormalised)
    w, frac = masked_importance_weights(learner, behaviour, floor=0.2, cap=4.0)
    close(w, [[1.0, 3.0, 0.25]])
    close(frac, 0.0)
    assert not w.requires_grad


def test_masked_weights_count_only_masked_tokens_and_check_bounds():
    learner, behaviour = raw_three()
    # the mask leaves out token 2 (w = 0.25): of tokens 0 and 1, one (w = 3) is out of [0.5, 2] -> 1/2
    _, frac = masked_importance_weights(learner, behaviour, 0.5, 2.0, mask=t([1, 1, 0]))
    close(frac, 0.5)
    for floor, cap in ((1.0, 2.0), (-0.1, 2.0), (0.5, 1.0)):
        with pytest.raises(ValueError, match="floor"):
            masked_importance_weights(learner, behaviour, floor, cap)


def test_effective_sample_size_hand_worked():
    mask = t([1, 1, 1])
    close(importance_ess(t([1.0, 1.0, 1.0]), mask), 1.0)  # equal weights: every token counts fully
    # w = [1, 2, 0.5]: (Σw)² / (n·Σw²) = 3.5² / (3 · 5.25) = 12.25 / 15.75 = 7/9
    close(importance_ess(t([1.0, 2.0, 0.5]), mask), 7 / 9)
    close(importance_ess(t([3.0, 0.0, 0.0]), mask), 1 / 3)  # one token carries it all: 9 / (3 · 9) = 1/n
    # padding holds inf: ignored. [1, 2]: 3² / (2 · 5) = 0.9
    close(importance_ess(t([1.0, 2.0, math.inf]), t([1, 1, 0])), 0.9)
    close(importance_ess(t([0.0, 0.0, 0.0]), mask), 0.0)  # everything dropped: no sample left
    close(importance_ess(t([1.0, 2.0, 0.5]), t([0, 0, 0])), 0.0)  # empty mask


def test_log_ratio_stats_report_the_raw_weights_ess():
    learner, behaviour = raw_three()
    # w = [1, 3, 0.25]: Σw = 4.25, Σw² = 1 + 9 + 0.0625 = 10.0625 -> 4.25² / (3 · 10.0625) = 18.0625 / 30.1875
    close(log_ratio_stats(learner, behaviour, t([1, 1, 1]))["is_ess"], 18.0625 / 30.1875)
    close(log_ratio_stats(learner, learner.clone(), t([1, 1, 1]))["is_ess"], 1.0)  # on-policy


def test_off_policy_weights_per_mode_and_padding():
    learner, behaviour = raw_three()
    mask = t([1, 1, 1])
    # "tis": min(w, 2) = [1, 2, 0.25]; mean 3.25/3; one truncated; ESS 3.25² / (3 · 5.0625) = 10.5625 / 15.1875
    w, m = off_policy_weights(learner, behaviour, mask, "tis", is_cap=2.0)
    close(w, [[1.0, 2.0, 0.25]])
    close(m["is_weight_mean"], 3.25 / 3)
    close(m["is_capped_frac"], 1 / 3)
    close(m["is_ess"], 10.5625 / 15.1875)
    # "decoupled": over 2 dropped = [1, 0, 0.25]
    w, m = off_policy_weights(learner, behaviour, mask, "decoupled", is_cap=2.0)
    close(w, [[1.0, 0.0, 0.25]])
    # "masked" [0.5, 2] = [1, 0, 0]: ESS 1 / (3 · 1) = 1/3
    w, m = off_policy_weights(learner, behaviour, mask, "masked", is_cap=2.0, is_floor=0.5)
    close(w, [[1.0, 0.0, 0.0]])
    close(m["is_capped_frac"], 2 / 3)
    close(m["is_ess"], 1 / 3)
    # padding (mask 0) gets weight exactly 1 whatever the behaviour log-prob holds (nan here)
    w, m = off_policy_weights(learner, t([-1.0, -1.0, math.nan]), t([1, 1, 0]), "masked", is_cap=2.0, is_floor=0.5)
    close(w, [[1.0, 1.0, 1.0]])
    close(m["is_ess"], 1.0)
    with pytest.raises(ValueError, match="'none'"):
        off_policy_weights(learner, behaviour, mask, "none", is_cap=2.0)


def test_ppo_masked_hand_worked():
    # π_θ = π_prox (r = 1, nothing clipped); w = [1, 3, 0.25] masked to [0.5, 2] -> [1, 0, 0]
    # per-token loss −A·r·w with A = 1: [-1, 0, 0] -> mean −1/3; gradient −w/3
    prox, behaviour = raw_three()
    logps = prox.clone().requires_grad_()
    loss, m = ppo_policy_loss(logps, prox, t([1.0, 1.0, 1.0]), t([1, 1, 1]), behaviour_logps=behaviour,
                              off_policy="masked", is_cap=2.0, is_floor=0.5)
    close(loss, -1 / 3)
    close(m["is_weight_mean"], 1 / 3)
    close(m["is_capped_frac"], 2 / 3)
    close(m["is_ess"], 1 / 3)
    loss.backward()
    close(logps.grad, [[-1 / 3, 0.0, 0.0]])
    # rloo_loss passes is_floor through: the same numbers with A = 1 per sequence
    loss, _ = rloo_loss(prox.clone(), prox, t(1.0), t([1, 1, 1]), behaviour_logps=behaviour,
                        off_policy="masked", is_cap=2.0, is_floor=0.5)
    close(loss, -1 / 3)
    with pytest.raises(ValueError, match="is_cap"):
        ppo_policy_loss(logps, prox, t([1.0, 1.0, 1.0]), t([1, 1, 1]), behaviour_logps=behaviour,
                        off_policy="masked", is_cap=None)


def test_grpo_masked_hand_worked():
    # one sequence, A = 2, r = 1; w masked to [0.5, 2] = [1, 0, 0]; "bnpo": Σ(−A·w)/tokens = (−2 + 0 + 0)/3
    prox, behaviour = raw_three()
    loss, m = grpo_loss(prox.clone(), prox, t(2.0), t([1, 1, 1]), loss_type="bnpo", behaviour_logps=behaviour,
                        off_policy="masked", is_cap=2.0, is_floor=0.5)
    close(loss, -2 / 3)
    close(m["is_ess"], 1 / 3)
    # with a wide window every weight is kept: (−2·1 − 2·3 − 2·0.25)/3 = −8.5/3
    loss, _ = grpo_loss(prox.clone(), prox, t(2.0), t([1, 1, 1]), loss_type="bnpo", behaviour_logps=behaviour,
                        off_policy="masked", is_cap=4.0, is_floor=0.2)
    close(loss, -8.5 / 3)
