"""algorithm.rollout_correction: the maths of the token-level correction against the rollout engine's
log-probs (tis, masked) by hand, the policy loss it weighs, and its config (strict; none by default)."""

import math

import pytest
import torch

from rlctl import algos
from rlctl.config import load_config
from rlctl.config.algorithm import AlgorithmConfig
from rlctl.errors import ConfigError

# Row 0: three response tokens, ratios pi_old / pi_rollout of 3, 0.8 and 0.25. Row 1: a response token
# (ratio 1), then a tool's token (masked out, rollout log-prob 0: ratio e^-5) and padding (ratio e^10).
OLD = torch.tensor([[math.log(3.0), math.log(0.8), math.log(0.25)], [-1.0, -5.0, 10.0]])
ROLLOUT = torch.tensor([[0.0, 0.0, 0.0], [-1.0, 0.0, 0.0]])
MASK = torch.tensor([[1, 1, 1], [1, 0, 0]])


def test_tis_by_hand():
    # weights min(rho, 2): 3 -> 2 (capped), 0.8, 0.25, 1; the tool's token and the padding weigh 0
    out = algos.rollout_correction(OLD, ROLLOUT, MASK, "tis", 2.0)
    assert out.weights.flatten().tolist() == pytest.approx([2.0, 0.8, 0.25, 1.0, 0.0, 0.0], rel=1e-6)
    assert out.ratio_mean.item() == pytest.approx((3.0 + 0.8 + 0.25 + 1.0) / 4, rel=1e-6)  # before the cap
    assert out.ratio_max.item() == pytest.approx(3.0, rel=1e-6)
    assert out.clipfrac.item() == pytest.approx(1 / 4)  # one token of four capped


def test_masked_by_hand():
    # inside [1/2, 2] weigh 1 (0.8 and 1), outside weigh 0 (3 and 0.25): two tokens of four masked
    out = algos.rollout_correction(OLD, ROLLOUT, MASK, "masked", 2.0)
    assert out.weights.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]
    assert out.ratio_mean.item() == pytest.approx(5.05 / 4, rel=1e-6)
    assert out.clipfrac.item() == pytest.approx(2 / 4)
    wide = algos.rollout_correction(OLD, ROLLOUT, MASK, "masked", 4.0)  # [1/4, 4]: 0.25 is inside, at the bound
    assert wide.weights.tolist() == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]] and wide.clipfrac.item() == 0.0


def test_agreeing_engines_weigh_one_and_no_token_leaves_zeros():
    lp = torch.tensor([[-0.3, -2.0], [-1.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    for mode in ("tis", "masked"):
        out = algos.rollout_correction(lp, lp.clone(), mask, mode, 2.0)
        assert out.weights.tolist() == [[1.0, 1.0], [1.0, 0.0]]
        assert (out.ratio_mean.item(), out.ratio_max.item(), out.clipfrac.item()) == (1.0, 1.0, 0.0)
        empty = algos.rollout_correction(lp, lp, torch.zeros(2, 2), mode, 2.0)
        assert empty.weights.abs().sum().item() == 0.0 and empty.ratio_max.item() == 0.0


def test_ratio_max_is_unbounded_the_weight_bounded_and_nan_is_never_hidden():
    old = torch.tensor([[30.0, 0.0, math.nan]])  # rho e^30: beyond the bound on the log (20) and the cap
    rollout = torch.zeros(1, 3)
    out = algos.rollout_correction(old, rollout, torch.tensor([[1, 1, 0]]), "tis", 2.0)
    assert out.ratio_max.item() == pytest.approx(math.exp(30.0), rel=1e-6)
    assert out.ratio_mean.item() == pytest.approx((math.exp(20.0) + 1.0) / 2, rel=1e-6)
    assert out.weights.tolist() == [[2.0, 1.0, 0.0]]  # the NaN is off the mask: no leak
    for mode in ("tis", "masked"):
        nan = algos.rollout_correction(old, rollout, torch.ones(1, 3), mode, 2.0)
        assert math.isnan(nan.weights[0, 2].item()) and math.isnan(nan.ratio_max.item())


def test_bad_mode_or_cap_is_refused():
    with pytest.raises(KeyError, match="unknown rollout correction mode 'is'; valid: tis, masked"):
        algos.rollout_correction(OLD, ROLLOUT, MASK, "is", 2.0)
    with pytest.raises(ValueError, match="must be > 1, got 1.0"):
        algos.rollout_correction(OLD, ROLLOUT, MASK, "tis", 1.0)


def test_the_weights_scale_each_tokens_policy_loss_and_gradient():
    # on-policy (ratio 1, no clip), A = 1: each token's loss is -w, the token mean over the 4 tokens
    lp = torch.tensor([[-1.0, -2.0, -0.5], [-0.7, -3.0, 0.0]], requires_grad=True)
    adv = torch.ones(2, 3)
    weights = algos.rollout_correction(OLD, ROLLOUT, MASK, "tis", 2.0).weights
    out = algos.compute_policy_loss(lp, lp.detach(), adv, MASK, clip_low=0.2, clip_high=0.2, token_weights=weights)
    assert out.pg_loss.item() == pytest.approx(-(2.0 + 0.8 + 0.25 + 1.0) / 4, rel=1e-6)
    out.pg_loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.5, -0.2, -0.0625, -0.25, 0.0, 0.0], rel=1e-6)  # -A w / 4
    masked = algos.rollout_correction(OLD, ROLLOUT, MASK, "masked", 2.0).weights
    out = algos.compute_policy_loss(lp, lp.detach(), adv, MASK, clip_low=0.2, clip_high=0.2, token_weights=masked)
    assert out.pg_loss.item() == pytest.approx(-2 / 4)  # the masked tokens still count in the mean's denominator
    # the clips and the metrics of the surrogate are the same with or without weights
    plain = algos.compute_policy_loss(lp, lp.detach() - 0.5, adv, MASK, clip_low=0.2, clip_high=0.2)
    ones = algos.compute_policy_loss(
        lp, lp.detach() - 0.5, adv, MASK, clip_low=0.2, clip_high=0.2, token_weights=torch.ones(2, 3)
    )
    assert torch.equal(plain.pg_loss, ones.pg_loss) and torch.equal(plain.pg_clipfrac, ones.pg_clipfrac)


def test_the_config_is_strict_and_off_by_default(tmp_path):
    rc = AlgorithmConfig().rollout_correction
    assert (rc.mode, rc.cap) == ("none", 2.0)
    assert AlgorithmConfig(rollout_correction={"mode": "masked", "cap": 1.5}).rollout_correction.cap == 1.5
    for data, sentence in [
        ({"mode": "truncate"}, "'none', 'tis' or 'masked'"),
        ({"cap": 1.0}, "greater than 1"),
        ({"mode": "tis", "threshold": 2.0}, "Extra inputs are not permitted"),
    ]:
        with pytest.raises(ValueError, match=sentence):
            AlgorithmConfig(rollout_correction=data)
    cfg = load_config(None, ["algorithm.rollout_correction.mode=tis", "algorithm.rollout_correction.cap=3"])
    assert (cfg.algorithm.rollout_correction.mode, cfg.algorithm.rollout_correction.cap) == ("tis", 3.0)
    with pytest.raises(ConfigError, match="algorithm.rollout_correction.mode"):
        load_config(None, ["algorithm.rollout_correction.mode=tiss"])


def test_the_cap_is_idle_without_a_correction():
    assert "mode is none" in AlgorithmConfig().idle_knob("algorithm.rollout_correction.cap")
    assert AlgorithmConfig(rollout_correction={"mode": "tis"}).idle_knob("algorithm.rollout_correction.cap") is None
