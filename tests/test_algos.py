"""Estimators and losses against values worked out by hand on small tensors, masks and padding included."""

import math

import pytest
import torch

from rlctl.engine import algos


def test_grpo_advantages_by_hand():
    # group 1: [1, 0, 0, 1] mean .5, unbiased std sqrt(1/3); group 2 all tie -> zero advantage
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3])
    adv = algos.grpo_advantages(scores, group_size=4, eps=1e-6)
    s = math.sqrt(1 / 3)
    expected = [0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_masked_mean_ignores_padding_but_propagates_nan_in_real_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert algos.masked_mean(x, mask).item() == pytest.approx(2.0)  # (1+2+3)/3, nan masked out
    mask2 = torch.tensor([[1, 1, 0], [1, 1, 0]])
    assert math.isnan(algos.masked_mean(x, mask2).item())


def test_count_nonfinite_counts_only_masked_in():
    x = torch.tensor([[float("nan"), 0.0, float("inf")], [0.0, -float("inf"), float("nan")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert algos.count_nonfinite(x, mask) == 3.0


def test_kl_estimators_by_hand():
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    # k1 = lp - ref
    assert algos.kl_penalty(lp, ref, "k1")[0].tolist() == pytest.approx([0.5, -1.0])
    # k2 = 0.5 (lp - ref)^2
    assert algos.kl_penalty(lp, ref, "k2")[0].tolist() == pytest.approx([0.125, 0.5])
    # k3 = exp(ref - lp) - (ref - lp) - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1]
    assert algos.kl_penalty(lp, ref, "k3")[0].tolist() == pytest.approx(k3, rel=1e-6)
    assert algos.kl_penalty(lp, ref, "low_var_kl")[0].tolist() == pytest.approx(k3, rel=1e-6)


def test_k3_is_clamped_and_cannot_overflow():
    lp = torch.tensor([[-100.0, 0.0]])
    ref = torch.tensor([[0.0, -100.0]])
    kl = algos.kl_penalty(lp, ref, "k3")
    assert torch.isfinite(kl).all()
    assert kl.max().item() == 10.0  # exp(20) - 20 - 1 clamped to 10
    assert kl.min().item() >= 0.0


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(KeyError, match="valid: k1, k2, k3, low_var_kl"):
        algos.kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), "k4")
    with pytest.raises(KeyError, match="valid: grpo"):
        algos.ADV_ESTIMATORS["ppo2"]


def test_policy_loss_by_hand():
    # token 1: ratio e^0.5 = 1.6487, adv +1 -> clipped at 1.2: loss max(-1.6487, -1.2) = -1.2, clipped
    # token 2: ratio e^-0.5 = 0.6065, adv +1 -> loss max(-0.6065, -0.8) = -0.6065, not clipped
    # token 3: ratio 1, adv -2 -> loss 2, not clipped
    # token 4: padding (ratio e^3, would be clipped) must not count
    lp = torch.tensor([[0.5, -0.5], [0.0, 3.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    pg_loss, clipfrac, ppo_kl = algos.policy_loss(lp, old, adv, mask, clip_ratio=0.2)
    assert pg_loss.item() == pytest.approx((-1.2 - math.exp(-0.5) + 2.0) / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    assert ppo_kl.item() == pytest.approx((-0.5 + 0.5 + 0.0) / 3, abs=1e-7)


def test_policy_loss_negative_advantage_clips_low():
    # ratio 0.5 with adv -1: unclipped 0.5, clipped -(-1)*0.8 = 0.8 -> loss 0.8, clipped
    lp = torch.tensor([[math.log(0.5)]])
    pg_loss, clipfrac, _ = algos.policy_loss(lp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), 0.2)
    assert pg_loss.item() == pytest.approx(0.8)
    assert clipfrac.item() == 1.0


def test_policy_loss_gradient_on_policy_is_minus_advantage():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -1.5]])
    loss, _, _ = algos.policy_loss(lp, lp.detach(), adv, torch.ones(1, 2), 0.2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-0.25, 0.75])  # -adv / n_tokens


def test_entropy_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    ent = algos.entropy_from_logits(logits)
    assert ent.tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_fixed_kl_controller_round_trips():
    ctrl = algos.FixedKLController(0.05)
    ctrl.update(current_kl=3.0, n_steps=10)
    assert ctrl.value == 0.05
    other = algos.FixedKLController(0.0)
    other.load_state_dict(ctrl.state_dict())
    assert other.value == 0.05
