"""GRPO's advantages and loss on hand-worked tensors (expected arithmetic in the comments), and AsyncGRPOConfig's
names, defaults and validation against TRL 1.16's GRPOConfig."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from async_rlhf import AsyncGRPOConfig
from async_rlhf.errors import ConfigError
from async_rlhf.losses.grpo import grpo_advantages, grpo_loss

EPS = 1e-4  # TRL's std epsilon
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # row 0: 3 tokens, row 1: 2 tokens + padding


# ---- advantages --------------------------------------------------------------------------------------------------
def test_group_scaling_and_zero_std_group():
    adv, zero = grpo_advantages(torch.tensor([[1.0, 2.0, 3.0], [5.0, 5.0, 5.0]]), "group")
    # group 0: mean 2, unbiased std sqrt(((-1)^2 + 0 + 1^2) / 2) = 1 -> (r - 2) / (1 + 1e-4)
    assert torch.allclose(adv[0], torch.tensor([-1.0, 0.0, 1.0]) / (1 + EPS))
    # group 1: all equal -> std 0, advantage 0 / (0 + 1e-4) = 0: no signal, flagged
    assert torch.equal(adv[1], torch.zeros(3))
    assert zero.tolist() == [[False] * 3, [True] * 3]


def test_two_sample_group():
    adv, _ = grpo_advantages(torch.tensor([[0.0, 1.0]]), "group")
    # mean 0.5, std sqrt((0.25 + 0.25) / 1) = 0.7071 -> ±0.5 / 0.7072
    assert torch.allclose(adv, torch.tensor([[-0.5, 0.5]]) / (math.sqrt(0.5) + EPS))


def test_batch_scaling_uses_one_std_but_group_means():
    adv, zero = grpo_advantages(torch.tensor([[0.0, 2.0], [4.0, 6.0]]), "batch")
    # centred by group means (1 and 5): [-1, 1], [-1, 1]; batch std: mean 3, squares 9 + 1 + 1 + 9 = 20, / 3
    std = math.sqrt(20 / 3)
    assert torch.allclose(adv, torch.tensor([[-1.0, 1.0], [-1.0, 1.0]]) / (std + EPS))
    assert not zero.any()


def test_no_scaling_only_centres():
    adv, zero = grpo_advantages(torch.tensor([[0.0, 2.0], [3.0, 3.0]]), "none")
    assert torch.equal(adv, torch.tensor([[-1.0, 1.0], [0.0, 0.0]]))
    assert zero.tolist() == [[False, False], [True, True]]  # still reported, as TRL's frac_reward_zero_std


def test_unscorable_completion_is_left_out_and_gets_zero_advantage():
    adv, _ = grpo_advantages(torch.tensor([[1.0, float("nan"), 3.0]]), "group")
    # mean and std over {1, 3}: mean 2, std sqrt(2) -> ∓1 / (sqrt(2) + 1e-4); the NaN one: 0
    expected = torch.tensor([[-1.0, 0.0, 1.0]]) / (math.sqrt(2) + EPS)
    expected[0, 1] = 0.0
    assert torch.allclose(adv, expected)


def test_advantage_bad_input():
    with pytest.raises(ValueError, match="k >= 2"):
        grpo_advantages(torch.tensor([[1.0], [2.0]]))
    with pytest.raises(ValueError, match="scale_rewards"):
        grpo_advantages(torch.tensor([[1.0, 2.0]]), "global")
    with pytest.raises(ValueError, match="num_prompts, k"):
        grpo_advantages(torch.tensor([1.0, 2.0]))


# ---- loss types, on-policy (ratio 1): token term = -A ------------------------------------------------------------
def _on_policy(loss_type, adv=(1.0, -0.5), **kw):
    logps = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]], requires_grad=True)
    loss, m = grpo_loss(logps, logps.detach().clone(), torch.tensor(adv), MASK, loss_type=loss_type, **kw)
    loss.backward()
    return loss, logps.grad, m


@pytest.mark.parametrize("loss_type, kw, expected", [
    ("grpo", {}, -0.25),  # row means: -1 and +0.5, mean over rows -0.25
    ("sapo", {}, None),  # checked below
    ("bnpo", {}, -0.4),  # token sum 3·(-1) + 2·0.5 = -2, over 5 tokens
    ("dr_grpo", {"max_completion_length": 5}, -0.2),  # -2 / (2 rows · 5)
    ("dapo", {}, -0.4),  # -2 / 5 tokens of this micro-batch (num_items default)
    ("dapo", {"num_items": 10.0}, -0.2),  # -2 / 10 tokens of the whole step
])
def test_loss_type_normalisation(loss_type, kw, expected):
    loss, grad, _ = _on_policy(loss_type, **kw)
    if expected is not None:
        assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert torch.all(grad[1, 2] == 0)  # padding gets no gradient


def test_grpo_gradient_weighs_each_sequence_equally():
    _, grad, _ = _on_policy("grpo")
    # d/dlogp of -A·r/len/B at r = 1: row 0: -1/3/2, row 1: +0.5/2/2
    assert torch.allclose(grad, torch.tensor([[-1 / 6] * 3, [0.125, 0.125, 0.0]]))


def test_dapo_gradient_weighs_each_token_equally():
    _, grad, _ = _on_policy("dapo")
    assert torch.allclose(grad, torch.tensor([[-0.2] * 3, [0.1, 0.1, 0.0]]))  # -A / 5 tokens


def test_sapo_soft_gate():
    loss, _, _ = _on_policy("sapo")
    # r = 1: σ(0)·4/τ = 2/τ; A > 0: τ = 1 -> token -2·1; A < 0: τ = 1.05 -> token -2/1.05·(-0.5)
    assert loss.item() == pytest.approx(((-2.0) + (2 / 1.05 * 0.5)) / 2, abs=1e-6)


def test_cispo_weight_is_detached_and_capped():
    logps = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, -3.0 - math.log(6.0)]])  # ratios 1, 1, 6
    loss, m = grpo_loss(logps, old, torch.tensor([1.0]), torch.ones(1, 3), loss_type="cispo", epsilon_high=5.0)
    loss.backward()
    # token terms -w·A·logp with w = (1, 1, min(6, 5)): 1 + 2 + 15 = 18, over 3 tokens
    assert loss.item() == pytest.approx(6.0, abs=1e-5)
    assert torch.allclose(logps.grad, torch.tensor([[-1 / 3, -1 / 3, -5 / 3]]))
    assert m["cispo_clip_ratio"].item() == pytest.approx(1 / 3)


# ---- clipping --------------------------------------------------------------------------------------------------
def _one_token(ratio, adv, **kw):
    logp = torch.tensor([[0.0]], requires_grad=True)
    loss, m = grpo_loss(logp, torch.tensor([[-math.log(ratio)]]), torch.tensor([adv]), torch.ones(1, 1),
                        loss_type="bnpo", **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), m


def test_symmetric_clip_stops_the_gradient_outside_the_trust_region():
    loss, grad, m = _one_token(1.5, 1.0)  # A > 0, r = 1.5 > 1.2: -min(1.5, 1.2) = -1.2, no gradient
    assert loss == pytest.approx(-1.2) and grad == 0.0
    assert m["clip_ratio/high_mean"].item() == 1.0 and m["clip_ratio/low_mean"].item() == 0.0
    loss, grad, m = _one_token(0.7, -1.0)  # A < 0, r = 0.7 < 0.8: -min(-0.7, -0.8) = 0.8, no gradient
    assert loss == pytest.approx(0.8) and grad == 0.0 and m["clip_ratio/low_mean"].item() == 1.0


def test_epsilon_high_widens_only_the_upper_bound():
    loss, grad, m = _one_token(1.5, 1.0, epsilon_high=0.6)  # 1.5 < 1.6: unclipped, -r·A, gradient -r
    assert loss == pytest.approx(-1.5) and grad == pytest.approx(-1.5)
    assert m["clip_ratio/region_mean"].item() == 0.0
    loss, _, _ = _one_token(0.7, -1.0, epsilon_high=0.6)  # the low bound is still 0.8
    assert loss == pytest.approx(0.8)


def test_delta_caps_the_unclipped_ratio():
    loss, _, _ = _one_token(2.0, -1.0)  # A < 0: -min(-2, -1.2) = 2: unbounded without delta
    assert loss == pytest.approx(2.0)
    loss, _, _ = _one_token(2.0, -1.0, delta=1.5)  # -min(-1.5, -1.2) = 1.5
    assert loss == pytest.approx(1.5)


def test_sequence_level_ratio_is_the_geometric_mean():
    logps = torch.tensor([[0.3, -0.1, 0.1]], requires_grad=True)
    loss, m = grpo_loss(logps, torch.zeros(1, 3), torch.tensor([1.0]), torch.ones(1, 3), loss_type="grpo",
                        importance_sampling_level="sequence", epsilon_low=0.5)
    # one ratio exp(mean(0.3, -0.1, 0.1)) = e^0.1 for every token, unclipped: loss -e^0.1
    assert loss.item() == pytest.approx(-math.exp(0.1), abs=1e-6)
    assert m["ratio_mean"].item() == pytest.approx(math.exp(0.1), abs=1e-6)


# ---- KL and off-policy weights -------------------------------------------------------------------------------
def test_k3_kl_term():
    logps = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.0 + math.log(2.0), -1.0]])  # d = ref - logp = ln 2 on token 0: k3 = 2 - ln 2 - 1
    k3 = 1.0 - math.log(2.0)
    loss, m = grpo_loss(logps, logps.detach(), torch.tensor([0.0]), torch.ones(1, 2), loss_type="bnpo",
                        ref_logps=ref, beta=0.1)
    assert loss.item() == pytest.approx(0.1 * k3 / 2, abs=1e-6)  # A = 0: only the KL term, token mean
    assert m["kl"].item() == pytest.approx(k3 / 2, abs=1e-6)
    loss.backward()
    # d/dlogp [r·k3] at r = 1 on token 0: k3 (from r) + (1 - e^d) = k3 - 1; over 2 tokens, times beta
    assert logps.grad[0, 0].item() == pytest.approx(0.1 * (k3 - 1) / 2, abs=1e-6)
    logps.grad = None
    loss, _ = grpo_loss(logps, logps.detach(), torch.tensor([0.0]), torch.ones(1, 2), loss_type="bnpo",
                        ref_logps=ref, beta=0.1, use_bias_correction_kl=False)
    loss.backward()
    assert logps.grad[0, 0].item() == pytest.approx(0.1 * (1 - 2.0) / 2, abs=1e-6)  # plain k3: 1 - e^d


def test_tis_weights_multiply_the_policy_term_only():
    logps = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0 - math.log(3.0), -1.0]])  # π_prox/μ = 3 on token 0 -> capped at 2; 1 on token 1
    loss, m = grpo_loss(logps, logps.detach(), torch.tensor([1.0]), torch.ones(1, 2), loss_type="bnpo",
                        behaviour_logps=behaviour, off_policy="tis", is_cap=2.0)
    assert loss.item() == pytest.approx((-2.0 - 1.0) / 2)  # token terms -A·r·w = -2, -1
    assert m["is_capped_frac"].item() == 0.5 and m["is_weight_mean"].item() == pytest.approx(1.5)
    loss, _ = grpo_loss(logps, logps.detach(), torch.tensor([1.0]), torch.ones(1, 2), loss_type="bnpo",
                        behaviour_logps=behaviour, off_policy="decoupled", is_cap=2.0)
    assert loss.item() == pytest.approx((0.0 - 1.0) / 2)  # decoupled drops the token above the cap


def test_zero_std_groups_give_no_policy_gradient():
    adv, _ = grpo_advantages(torch.tensor([[1.0, 1.0], [0.0, 0.0]]))
    logps = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-1.0, 0.0], [-3.0, -1.0]], requires_grad=True)
    loss, _ = grpo_loss(logps, logps.detach() - 0.3, adv.reshape(-1), torch.ones(4, 2), loss_type="dapo")
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logps.grad == 0)


def test_padding_garbage_does_not_leak():
    logps = torch.tensor([[-1.0, float("nan")], [-1.0, float("inf")]], requires_grad=True)
    old = torch.tensor([[-1.0, float("-inf")], [-1.2, 5.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    for loss_type in ("grpo", "bnpo", "dapo", "cispo", "sapo"):
        logps.grad = None
        loss, _ = grpo_loss(logps, old, torch.tensor([1.0, -1.0]), mask, loss_type=loss_type,
                            ref_logps=torch.zeros(2, 2), beta=0.1)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(logps.grad).all(), loss_type
        assert torch.all(logps.grad[:, 1] == 0), loss_type


def test_loss_bad_input_names_the_argument():
    x, m = torch.zeros(2, 3), torch.ones(2, 3)
    a = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type 'ppo'"):
        grpo_loss(x, x, a, m, loss_type="ppo")
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo_loss(x, x, a, m, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="ref_logps"):
        grpo_loss(x, x, a, m, beta=0.1)
    with pytest.raises(ValueError, match="advantages must be"):
        grpo_loss(x, x, torch.zeros(3), m)
    with pytest.raises(ValueError, match="shape mismatch"):
        grpo_loss(x, torch.zeros(2, 4), a, m)
    with pytest.raises(ValueError, match="behaviour_logps"):
        grpo_loss(x, x, a, m, off_policy="tis")


# ---- config ---------------------------------------------------------------------------------------------------
GRPO_NAMES = ["beta", "epsilon", "epsilon_high", "delta", "loss_type", "scale_rewards", "num_generations",
              "temperature", "learning_rate", "importance_sampling_level", "mask_truncated_completions",
              "use_bias_correction_kl", "num_iterations", "sapo_temperature_pos", "sapo_temperature_neg", "top_p",
              "top_k", "reward_weights"]


def test_config_defaults_are_trls():
    from trl import GRPOConfig

    theirs = {f.name: f.default for f in dataclasses.fields(GRPOConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    for name in GRPO_NAMES:
        assert ours[name] == theirs[name], name
    assert "max_completion_length" in ours  # TRL's name (None here: max_new_tokens's CPU-sized default applies)


def test_config_mapping_and_validation(tmp_path):
    c = AsyncGRPOConfig(output_dir=str(tmp_path), scale_rewards=False, max_completion_length=7)
    assert c.scale_rewards == "none" and c.max_new_tokens == 7
    assert AsyncGRPOConfig(output_dir=str(tmp_path), scale_rewards=True).scale_rewards == "group"
    assert AsyncGRPOConfig(output_dir=str(tmp_path), scale_rewards="False").scale_rewards == "none"  # a flag's text
    for bad, field in [({"loss_type": "ppo"}, "loss_type"), ({"scale_rewards": "global"}, "scale_rewards"),
                       ({"num_iterations": 0}, "num_iterations"), ({"delta": 0.5}, "delta"),
                       ({"importance_sampling_level": "batch"}, "importance_sampling_level")]:
        with pytest.raises(ConfigError, match=f"^{field}:"):
            AsyncGRPOConfig(output_dir=str(tmp_path), **bad)
    with pytest.raises(ConfigError, match="^GRPO requires at least 2 generations per prompt"):  # TRL's message
        AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=1)
