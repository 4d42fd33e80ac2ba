"""Hand-worked tests for `async_rlhf.losses`: three-element tensors, the expected arithmetic in comments."""

import math

import pytest
import torch

from async_rlhf.losses import (
    best_of_n_nll,
    dpo_loss,
    gae_advantages,
    kl_shaped_rewards,
    log_ratio_stats,
    masked_mean,
    ppo_policy_loss,
    ppo_value_loss,
    rloo_advantages,
    rloo_loss,
    truncated_importance_weights,
    whiten,
)

LN2, LN3 = math.log(2.0), math.log(3.0)


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual, dtype=torch.float32)
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


def assert_detached_scalars(metrics):
    for name, value in metrics.items():
        assert isinstance(value, torch.Tensor) and value.dim() == 0, name
        assert not value.requires_grad, name
        assert "/" not in name or name.split("/")[0] in ("rewards", "logps"), f"{name} carries a stage prefix"


# ----------------------------------------------------------------------------------------------------- masked_mean


def test_masked_mean_ignores_padding_even_nan_and_empty_mask_is_zero():
    # (1 + 3) / 2 = 2; the nan sits under mask 0
    close(masked_mean(t(1.0, 3.0, float("nan")), t(1, 1, 0)), 2.0)
    close(masked_mean(t(1.0, 2.0, 3.0), torch.tensor([False, False, False])), 0.0)


# ------------------------------------------------------------------------------------------------------------- DPO


def dpo_inputs():
    # chosen log-ratio   π_c − ref_c = [-1 − -1, -2 − -3, -3 − -2] = [0,  1, -1]
    # rejected log-ratio π_r − ref_r = [-2 − -2, -2 − -1, -2 − -2] = [0, -1,  0]
    # h = chosen − rejected = [0, 2, -1]
    return dict(
        policy_chosen_logps=t(-1.0, -2.0, -3.0).requires_grad_(),
        policy_rejected_logps=t(-2.0, -2.0, -2.0).requires_grad_(),
        ref_chosen_logps=t(-1.0, -3.0, -2.0),
        ref_rejected_logps=t(-2.0, -1.0, -2.0),
    )


def test_dpo_sigmoid_hand_worked():
    inputs = dpo_inputs()
    loss, metrics = dpo_loss(**inputs, beta=0.5)
    # β·h = [0, 1, -0.5]; −log σ(z) = log(1 + e^−z):
    #   log 2 = 0.693147, log(1 + e^−1) = 0.313262, log(1 + e^0.5) = 0.974077
    #   mean = (0.693147 + 0.313262 + 0.974077) / 3 = 0.660162
    close(loss, 0.660162)
    # rewards/chosen   = mean(0.5·[0, 1, -1]) = 0;  rewards/rejected = mean(0.5·[0, -1, 0]) = -1/6
    # margins = mean([0, 1, -0.5]) = 1/6;  accuracies: chosen > rejected only in pair 2 -> 1/3
    close(metrics["rewards/chosen"], 0.0)
    close(metrics["rewards/rejected"], -1 / 6)
    close(metrics["rewards/margins"], 1 / 6)
    close(metrics["rewards/accuracies"], 1 / 3)
    # logps: mean([-1, -2, -3]) = -2, mean([-2, -2, -2]) = -2
    close(metrics["logps/chosen"], -2.0)
    close(metrics["logps/rejected"], -2.0)
    close(metrics["loss"], loss.detach())
    assert_detached_scalars(metrics)
    assert set(metrics) == {
        "rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies",
        "logps/chosen", "logps/rejected", "loss",
    }


def test_dpo_sigmoid_gradient_raises_chosen_lowers_rejected():
    inputs = dpo_inputs()
    loss, _ = dpo_loss(**inputs, beta=0.5)
    loss.backward()
    # d loss / d π_c,i = −(β/3)·σ(−β·h_i) = −(0.5/3)·[σ(0), σ(-1), σ(0.5)] = [-0.083333, -0.044824, -0.103743]
    close(inputs["policy_chosen_logps"].grad, [-0.083333, -0.044824, -0.103743])
    # and the rejected gradient is its mirror image: gradient descent raises chosen, lowers rejected
    close(inputs["policy_rejected_logps"].grad, [0.083333, 0.044824, 0.103743])


def test_ipo_hand_worked():
    inputs = dpo_inputs()
    loss, metrics = dpo_loss(**inputs, beta=0.5, loss_type="ipo")
    # target 1/(2β) = 1; (h − 1)² = [(0-1)², (2-1)², (-1-1)²] = [1, 1, 4]; mean = 6/3 = 2
    close(loss, 2.0)
    loss.backward()
    # d/dπ_c = 2(h − 1)/3 = [-2/3, 2/3, -4/3]: IPO pulls the margin to 1/(2β) from both sides
    close(inputs["policy_chosen_logps"].grad, [-2 / 3, 2 / 3, -4 / 3])
    close(metrics["rewards/margins"], 1 / 6)


def test_dpo_reference_gets_no_gradient_and_zero_margin_is_log2():
    ref = t(-1.0, -2.0, -3.0).requires_grad_()
    # policy == reference everywhere: h = 0, loss = −log σ(0) = log 2 = 0.693147
    loss, metrics = dpo_loss(ref.detach().clone(), ref.detach().clone(), ref, ref, beta=0.1)
    close(loss, LN2)
    close(metrics["rewards/accuracies"], 0.0)  # 0 > 0 is false
    assert not loss.requires_grad  # only the reference carried grad, and it is detached


def test_dpo_rejects_unknown_loss_type_naming_valid_ones():
    with pytest.raises(ValueError, match="sigmoid.*ipo"):
        dpo_loss(**dpo_inputs(), beta=0.1, loss_type="hinge")


def test_dpo_rejects_shape_mismatch_and_bad_beta():
    inputs = dpo_inputs()
    inputs["ref_rejected_logps"] = t(-2.0, -1.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        dpo_loss(**inputs, beta=0.1)
    with pytest.raises(ValueError, match=r"\[B\]"):
        dpo_loss(*(t([-1.0, -2.0, -3.0]) for _ in range(4)), beta=0.1)
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(**dpo_inputs(), beta=0.0)


# ------------------------------------------------------------------------------------------------------ off-policy


def test_log_ratio_stats_hand_worked():
    # ρ = learner − behaviour = [0, ln 2, -ln 2];  w = e^ρ = [1, 2, 0.5]
    learner = t([-1.0, -1.0 + LN2, -1.0 - LN2])
    behaviour = t([-1.0, -1.0, -1.0])
    m = log_ratio_stats(learner, behaviour, t([1, 1, 1]))
    close(m["log_ratio_mean"], 0.0)  # (0 + ln2 − ln2) / 3
    close(m["log_ratio_abs_mean"], 2 * LN2 / 3)  # 0.462098
    close(m["log_ratio_abs_max"], LN2)
    close(m["seq_log_ratio_abs_mean"], 0.0)  # |0 + ln2 − ln2|
    close(m["is_weight_mean"], 3.5 / 3)  # (1 + 2 + 0.5) / 3
    close(m["is_weight_max"], 2.0)
    # k3 = (w − 1) − ρ = [0, 1 − ln2, −0.5 + ln2] -> sum 0.5 -> mean 1/6
    close(m["kl"], 1 / 6)
    assert_detached_scalars(m)


def test_log_ratio_stats_ignores_padding_garbage():
    # only token 1 counts: ρ = ln 2; the padded positions hold inf and nan
    learner = t([-1.0 + LN2, float("inf"), float("nan")])
    behaviour = t([-1.0, 0.0, 0.0])
    m = log_ratio_stats(learner, behaviour, torch.tensor([[True, False, False]]))
    close(m["log_ratio_abs_max"], LN2)
    close(m["is_weight_mean"], 2.0)
    close(m["seq_log_ratio_abs_mean"], LN2)


def test_importance_weights_exactly_one_when_behaviour_equals_learner():
    logps = t([-0.3, -1.7, -2.9], [-0.1, -4.0, -0.5])
    weights, frac = truncated_importance_weights(logps, logps.clone(), cap=2.0)
    assert torch.equal(weights, torch.ones_like(logps))  # exp(0) == 1.0 exactly
    assert frac.item() == 0.0
    m = log_ratio_stats(logps, logps.clone(), torch.ones_like(logps))
    assert m["is_weight_mean"].item() == 1.0 and m["log_ratio_abs_max"].item() == 0.0 and m["kl"].item() == 0.0


def test_truncated_importance_weights_hand_worked():
    # raw w = exp([0, ln 3, -ln 2]) = [1, 3, 0.5];  min(w, 2) = [1, 2, 0.5];  1 of 3 tokens truncated
    learner = t([0.0, LN3, -LN2]).requires_grad_()
    weights, frac = truncated_importance_weights(learner, t([0.0, 0.0, 0.0]), cap=2.0)
    close(weights, [[1.0, 2.0, 0.5]])
    close(frac, 1 / 3)
    assert not weights.requires_grad and not frac.requires_grad
    # with a mask hiding the truncated token, nothing counted was truncated: 0 / 2
    _, frac = truncated_importance_weights(learner, t([0.0, 0.0, 0.0]), cap=2.0, mask=t([1, 0, 1]))
    close(frac, 0.0)
    with pytest.raises(ValueError, match="cap"):
        truncated_importance_weights(learner, learner, cap=0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        truncated_importance_weights(learner, t([0.0, 0.0]), cap=2.0)


# ------------------------------------------------------------------------------------------------------------- PPO


def test_gae_gamma_one_lambda_half():
    # rewards [0, 0, 1], V = [0.5, 0.5, 0.5], γ = 1, λ = 0.5
    # δ_2 = 1 + 0 − 0.5 = 0.5 (episode ends);  δ_1 = 0 + 0.5 − 0.5 = 0;  δ_0 = 0
    # A_2 = 0.5;  A_1 = 0 + 0.5·0.5 = 0.25;  A_0 = 0 + 0.5·0.25 = 0.125
    # returns = A + V = [0.625, 0.75, 1.0]
    adv, ret = gae_advantages(t([0.0, 0.0, 1.0]), t([0.5, 0.5, 0.5]), t([1, 1, 1]), gamma=1.0, lam=0.5)
    close(adv, [[0.125, 0.25, 0.5]])
    close(ret, [[0.625, 0.75, 1.0]])


def test_gae_lambda_one_zero_values_is_discounted_return():
    # V = 0, γ = 0.5, λ = 1: A_t = Σ γ^l r_{t+l} = [0.25, 0.5, 1]
    adv, ret = gae_advantages(t([0.0, 0.0, 1.0]), t([0.0, 0.0, 0.0]), t([1, 1, 1]), gamma=0.5, lam=1.0)
    close(adv, [[0.25, 0.5, 1.0]])
    close(ret, [[0.25, 0.5, 1.0]])


def test_gae_ignores_padding_and_detaches():
    # mask [1, 1, 0]: the episode ends at t = 1, so V_2 = 9 and r_2 = 5 are padding and never bootstrap
    # δ_1 = 1 + 1·0 − 0.5 = 0.5 -> A_1 = 0.5;  δ_0 = 0 + 0.5 − 0.5 = 0 -> A_0 = 0 + 0.5·0.5 = 0.25
    values = t([0.5, 0.5, 9.0]).requires_grad_()
    adv, ret = gae_advantages(t([0.0, 1.0, 5.0]), values, t([1, 1, 0]), gamma=1.0, lam=0.5)
    close(adv, [[0.25, 0.5, 0.0]])
    close(ret, [[0.75, 1.0, 0.0]])  # A + V on tokens, 0 on padding
    assert not adv.requires_grad and not ret.requires_grad


def test_whiten_hand_worked():
    # mean 2, unbiased var ((−1)² + 0² + 1²) / (3 − 1) = 1 -> [−1, 0, 1]
    close(whiten(t([1.0, 2.0, 3.0]), t([1, 1, 1])), [[-1.0, 0.0, 1.0]])
    # mask [1, 1, 0]: mean 2, unbiased var (1 + 1) / 1 = 2 -> [−1/√2, 1/√2, 0 (padding)]
    close(whiten(t([1.0, 3.0, 100.0]), t([1, 1, 0])), [[-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0]])
    # shift_mean=False only rescales: [−1, 0, 1] + 2
    close(whiten(t([1.0, 2.0, 3.0]), t([1, 1, 1]), shift_mean=False), [[1.0, 2.0, 3.0]])
    with pytest.raises(ValueError, match="at least 2"):
        whiten(t([1.0, 2.0, 3.0]), t([1, 0, 0]))


def ppo_inputs():
    # log r = logps − old = [0, ln 1.5, ln 0.5] -> r = [1, 1.5, 0.5]
    old = t([-1.0, -1.0, -1.0])
    logps = (old + t([0.0, math.log(1.5), math.log(0.5)])).requires_grad_()
    return logps, old


def test_ppo_policy_loss_hand_worked_positive_advantages():
    logps, old = ppo_inputs()
    # A = [1, 1, 1], ε = 0.2: clip(r) = [1, 1.2, 0.8]
    # −A·r = [-1, -1.5, -0.5];  −A·clip(r) = [-1, -1.2, -0.8];  max = [-1, -1.2, -0.5] -> mean = -2.7/3 = -0.9
    loss, m = ppo_policy_loss(logps, old, t([1.0, 1.0, 1.0]), t([1, 1, 1]), clip_eps=0.2)
    close(loss, -0.9)
    close(m["loss"], -0.9)
    close(m["clipfrac"], 1 / 3)  # only token 2 (r = 1.5 > 1.2) takes the clipped branch
    close(m["ratio_mean"], 1.0)  # (1 + 1.5 + 0.5) / 3
    close(m["ratio_max"], 1.5)
    close(m["approxkl"], 0.107476)  # 0.5·(0 + ln²1.5 + ln²0.5)/3 = 0.5·(0.164402 + 0.480453)/3
    assert_detached_scalars(m)
    assert set(m) == {"loss", "clipfrac", "approxkl", "ratio_mean", "ratio_max"}
    loss.backward()
    # d(−A·r)/d logp = −A·r; /3 for the mean: token 0 -> −1/3; token 1 clipped -> 0; token 2 (r = 0.5 is
    # the pessimistic branch, not clipped for A > 0) -> −0.5/3. Descent raises the log-prob of good tokens.
    close(logps.grad, [[-1 / 3, 0.0, -1 / 6]])


def test_ppo_policy_loss_negative_advantages_clip_the_other_side():
    logps, old = ppo_inputs()
    # A = [-1, -1, -1]: −A·r = [1, 1.5, 0.5];  −A·clip(r) = [1, 1.2, 0.8];  max = [1, 1.5, 0.8] -> mean 3.3/3 = 1.1
    loss, m = ppo_policy_loss(logps, old, t([-1.0, -1.0, -1.0]), t([1, 1, 1]), clip_eps=0.2)
    close(loss, 1.1)
    close(m["clipfrac"], 1 / 3)  # token 2 (r = 0.5 < 0.8) is clipped
    loss.backward()
    # token 0: r/3 = 1/3; token 1 (unclipped, r = 1.5): 1.5/3 = 0.5; token 2 clipped: 0.
    # Descent lowers the log-prob of bad tokens.
    close(logps.grad, [[1 / 3, 0.5, 0.0]])


def test_ppo_policy_loss_mask_ignores_padding_garbage():
    logps, old = ppo_inputs()
    # pad a 4th token holding nan/inf: the loss must equal the 3-token one (−0.9) with a finite gradient
    logps4 = torch.cat([logps, t([float("nan")])], dim=1)
    old4 = torch.cat([old, t([float("inf")])], dim=1)
    loss, _ = ppo_policy_loss(logps4, old4, t([1.0, 1.0, 1.0, float("nan")]), t([1, 1, 1, 0]))
    close(loss, -0.9)
    loss.backward()
    close(logps.grad, [[-1 / 3, 0.0, -1 / 6]])


def test_ppo_tis_hand_worked():
    # π_θ = π_prox (r = 1, nothing clipped); log π_prox − log μ = [0, ln 3, -ln 2] -> raw w = [1, 3, 0.5]
    # truncated at 2: w = [1, 2, 0.5];  per-token loss −A·r·w with A = 1: [-1, -2, -0.5] -> mean -3.5/3
    prox = t([-1.0, -1.0, -1.0])
    logps = prox.clone().requires_grad_()
    behaviour = prox - t([0.0, LN3, -LN2])
    loss, m = ppo_policy_loss(
        logps, prox, t([1.0, 1.0, 1.0]), t([1, 1, 1]), behaviour_logps=behaviour, off_policy="tis", is_cap=2.0
    )
    close(loss, -3.5 / 3)
    close(m["is_weight_mean"], 3.5 / 3)
    close(m["is_capped_frac"], 1 / 3)
    loss.backward()
    close(logps.grad, [[-1 / 3, -2 / 3, -1 / 6]])  # −w/3: the weight scales each token's gradient


def test_ppo_decoupled_drops_over_cap_tokens_or_keeps_all_with_no_cap():
    prox = t([-1.0, -1.0, -1.0])
    behaviour = prox - t([0.0, LN3, -LN2])  # w = π_prox/μ = [1, 3, 0.5]
    adv, mask = t([1.0, 1.0, 1.0]), t([1, 1, 1])
    # cap 2: token 1 (w = 3) is dropped, still counted: (−1 + 0 − 0.5)/3 = −0.5
    loss, m = ppo_policy_loss(prox.clone(), prox, adv, mask, behaviour_logps=behaviour, off_policy="decoupled")
    close(loss, -0.5)
    close(m["is_weight_mean"], 0.5)  # (1 + 0 + 0.5)/3
    close(m["is_capped_frac"], 1 / 3)
    # no cap (Hilton's objective as written): (−1 − 3 − 0.5)/3 = −1.5
    loss, m = ppo_policy_loss(
        prox.clone(), prox, adv, mask, behaviour_logps=behaviour, off_policy="decoupled", is_cap=None
    )
    close(loss, -1.5)
    close(m["is_capped_frac"], 0.0)


def test_ppo_decoupled_clips_against_proximal_not_behaviour():
    # μ is far away (log π_prox − log μ = ln 1.1 on every token, w = 1.1 < cap), but π_θ vs π_prox is the
    # ratio of ppo_inputs: r = [1, 1.5, 0.5] -> clipping exactly as in the on-policy case, every term × 1.1
    logps, prox = ppo_inputs()
    behaviour = prox - math.log(1.1)
    loss, m = ppo_policy_loss(
        logps, prox, t([1.0, 1.0, 1.0]), t([1, 1, 1]), behaviour_logps=behaviour, off_policy="decoupled"
    )
    close(loss, -0.9 * 1.1)  # −0.99
    close(m["clipfrac"], 1 / 3)
    loss.backward()
    close(logps.grad, [[-1.1 / 3, 0.0, -1.1 / 6]])


def test_ppo_off_policy_modes_reduce_to_plain_ppo_when_behaviour_is_proximal():
    logps, old = ppo_inputs()
    adv, mask = t([1.0, -2.0, 0.5]), t([1, 1, 1])
    plain, _ = ppo_policy_loss(logps, old, adv, mask)
    for mode in ("tis", "decoupled"):
        loss, m = ppo_policy_loss(logps, old, adv, mask, behaviour_logps=old.clone(), off_policy=mode)
        assert torch.equal(loss, plain), mode  # all weights are exactly 1
        assert m["is_weight_mean"].item() == 1.0 and m["is_capped_frac"].item() == 0.0


def test_ppo_policy_loss_errors():
    logps, old = ppo_inputs()
    adv, mask = t([1.0, 1.0, 1.0]), t([1, 1, 1])
    with pytest.raises(ValueError, match="none, tis, decoupled"):
        ppo_policy_loss(logps, old, adv, mask, off_policy="vtrace")
    with pytest.raises(ValueError, match="needs behaviour_logps"):
        ppo_policy_loss(logps, old, adv, mask, off_policy="tis")
    with pytest.raises(ValueError, match="old_logps"):
        ppo_policy_loss(logps, old, adv, mask, behaviour_logps=old)
    with pytest.raises(ValueError, match="is_cap"):
        ppo_policy_loss(logps, old, adv, mask, behaviour_logps=old, off_policy="tis", is_cap=None)
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo_policy_loss(logps, old, adv, t([1, 1]))
    with pytest.raises(ValueError, match="shape mismatch"):
        ppo_policy_loss(logps, old, adv, mask, behaviour_logps=t([0.0, 0.0]), off_policy="tis")


def test_ppo_value_loss_hand_worked():
    # V_old = 0, R = 1, c = 0.2;  V = [0.1, 0.5, -0.5] -> V_clip = [0.1, 0.2, -0.2]
    # (V − R)² = [0.81, 0.25, 2.25];  (V_clip − R)² = [0.81, 0.64, 1.44];  max = [0.81, 0.64, 2.25]
    # loss = 0.5 · (0.81 + 0.64 + 2.25)/3 = 0.5 · 1.233333 = 0.616667
    values = t([0.1, 0.5, -0.5]).requires_grad_()
    loss, m = ppo_value_loss(values, t([0.0, 0.0, 0.0]), t([1.0, 1.0, 1.0]), t([1, 1, 1]), clip_range_value=0.2)
    close(loss, 0.616667)
    close(m["clipfrac"], 1 / 3)  # token 1: 0.64 > 0.25
    close(m["values_mean"], 0.1 / 3)
    close(m["returns_mean"], 1.0)
    assert_detached_scalars(m)
    loss.backward()
    # 0.5·2(V − R)/3 on unclipped tokens: [(0.1 − 1)/3, 0 (clipped: clamp saturated), (−0.5 − 1)/3]
    #   = [-0.3, 0, -0.5]
    close(values.grad, [[-0.3, 0.0, -0.5]])


# ------------------------------------------------------------------------------------------------------------ RLOO


def test_rloo_advantages_hand_worked():
    # baselines: (2+3)/2 = 2.5, (1+3)/2 = 2, (1+2)/2 = 1.5 -> A = [1 − 2.5, 2 − 2, 3 − 1.5] = [-1.5, 0, 1.5]
    # second prompt, k = 3: rewards [0, 0, 3] -> baselines [1.5, 1.5, 0] -> A = [-1.5, -1.5, 3]
    adv = rloo_advantages(t([1.0, 2.0, 3.0], [0.0, 0.0, 3.0]))
    close(adv, [[-1.5, 0.0, 1.5], [-1.5, -1.5, 3.0]])
    close(adv.sum(dim=1), [0.0, 0.0])


def test_rloo_advantages_errors():
    with pytest.raises(ValueError, match="k >= 2"):
        rloo_advantages(t([1.0], [2.0], [3.0]))
    with pytest.raises(ValueError, match="num_prompts, k"):
        rloo_advantages(torch.tensor([1.0, 2.0, 3.0]))


def test_kl_shaped_rewards_hand_worked():
    scores = torch.tensor([1.0, 2.0, 3.0])
    ref = torch.zeros(3, 3)
    # log π − log π_ref per row: [0.1, 0.2, 0.3] -> Σ 0.6;  [0, 0, 0] -> 0;  [-0.5, 0.5, 9 (padding)] -> 0
    logps = t([0.1, 0.2, 0.3], [0.0, 0.0, 0.0], [-0.5, 0.5, 9.0]).requires_grad_()
    mask = t([1, 1, 1], [1, 1, 1], [1, 1, 0])
    # score − 0.5·KL = [1 − 0.3, 2 − 0, 3 − 0] = [0.7, 2, 3]
    rewards = kl_shaped_rewards(scores, logps, ref, mask, kl_coef=0.5)
    close(rewards, [0.7, 2.0, 3.0])
    assert not rewards.requires_grad
    with pytest.raises(ValueError, match="scores must be"):
        kl_shaped_rewards(scores[:2], logps, ref, mask, kl_coef=0.5)


def test_rloo_loss_broadcasts_sequence_advantage_over_tokens():
    # r = 1 everywhere; A = [1, -1] per sequence; mask has 3 + 1 tokens:
    # per-token −A = [-1, -1, -1 | 1] -> mean (−3 + 1)/4 = −0.5  (token-level mean: long sequences weigh more)
    logps = torch.zeros(2, 3, requires_grad=True)
    mask = t([1, 1, 1], [1, 0, 0])
    loss, m = rloo_loss(logps, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask)
    close(loss, -0.5)
    loss.backward()
    close(logps.grad, [[-0.25, -0.25, -0.25], [0.25, 0.0, 0.0]])  # −A/4 on tokens, 0 on padding
    # identical to ppo_policy_loss with the advantage expanded by hand
    ref_loss, ref_m = ppo_policy_loss(logps, torch.zeros(2, 3), t([1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]), mask)
    assert torch.equal(loss, ref_loss) and m.keys() == ref_m.keys()


def test_rloo_loss_passes_off_policy_mode_through_and_checks_shapes():
    logps = torch.zeros(1, 3)
    behaviour = t([0.0, -LN3, LN2])  # π_prox/μ = [1, 3, 0.5] -> truncated [1, 2, 0.5]
    loss, m = rloo_loss(logps, torch.zeros(1, 3), torch.tensor([1.0]), t([1, 1, 1]),
                        behaviour_logps=behaviour, off_policy="tis")
    close(loss, -3.5 / 3)  # as in test_ppo_tis_hand_worked
    close(m["is_capped_frac"], 1 / 3)
    with pytest.raises(ValueError, match="one per sequence"):
        rloo_loss(logps, logps, torch.zeros(1, 3), t([1, 1, 1]))


# ------------------------------------------------------------------------------------------------------------- SFT


def test_best_of_n_nll_hand_worked():
    # tokens [-1, -2 | -3 (padding)] and [-0.5, -0.5, -0.5]: NLL = (1 + 2 + 0.5·3)/5 = 4.5/5 = 0.9
    logps = t([-1.0, -2.0, -3.0], [-0.5, -0.5, -0.5]).requires_grad_()
    loss, m = best_of_n_nll(logps, torch.tensor([[True, True, False], [True, True, True]]))
    close(loss, 0.9)
    close(m["num_tokens"], 5.0)
    assert_detached_scalars(m)
    loss.backward()
    # d/d logp = −1/5 on every counted token: descent raises the kept sample's likelihood
    close(logps.grad, [[-0.2, -0.2, 0.0], [-0.2, -0.2, -0.2]])
    with pytest.raises(ValueError, match="shape mismatch"):
        best_of_n_nll(logps, t([1, 1, 1]))
