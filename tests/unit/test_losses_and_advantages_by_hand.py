"""Estimators and losses against values worked out by hand on small tensors, masks and padding included."""

import math

import pytest
import torch

from rlctl import algos
from rlctl.engine import microbatch
from rlctl.engine.batch import Sequences


def test_grpo_advantages_by_hand():
    # group 1: [1, 0, 0, 1] mean .5, unbiased std sqrt(1/3); group 2 all tie -> zero advantage
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3])
    mask = torch.ones(8, 1)
    inp = algos.AdvantageInputs(algos.scores_to_token_rewards(scores, mask), mask, group_size=4, eps=1e-6)
    adv = algos.ADVANTAGES["grpo"](inp)[0][:, 0]
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
    with pytest.raises(
        KeyError, match="valid: drgrpo, gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo"
    ):
        algos.ADVANTAGES["ppo2"]


def test_policy_loss_by_hand():
    # token 1: ratio e^0.5 = 1.6487, adv +1 -> clipped at 1.2: loss max(-1.6487, -1.2) = -1.2, clipped
    # token 2: ratio e^-0.5 = 0.6065, adv +1 -> loss max(-0.6065, -0.8) = -0.6065, not clipped
    # token 3: ratio 1, adv -2 -> loss 2, not clipped
    # token 4: padding (ratio e^3, would be clipped) must not count
    lp = torch.tensor([[0.5, -0.5], [0.0, 3.0]])
    old = torch.zeros(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-2.0, -2.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    out = algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=None)
    pg_loss, clipfrac, ppo_kl = out.pg_loss, out.pg_clipfrac, out.ppo_kl
    assert pg_loss.item() == pytest.approx((-1.2 - math.exp(-0.5) + 2.0) / 3, rel=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)
    assert ppo_kl.item() == pytest.approx((-0.5 + 0.5 + 0.0) / 3, abs=1e-7)


def test_policy_loss_ratio_max_is_before_clamp_and_clip_and_ignores_padding():
    # real tokens: log-ratios 0.5, -0.5, 25 (ratio e^25 = 7.2e10: beyond the loss's clamp at e^20 and any
    # clip); padding has e^30, which must not count
    lp = torch.tensor([[0.5, -0.5], [25.0, 30.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    adv = torch.ones(2, 2)
    out = algos.compute_policy_loss(lp, torch.zeros(2, 2), adv, mask, clip_low=0.2, clip_high=0.2)
    assert out.ratio_max.item() == pytest.approx(math.exp(25.0), rel=1e-6)
    on = algos.compute_policy_loss(lp, lp.detach(), adv, mask, clip_low=0.2, clip_high=0.2, level="sequence")
    assert on.ratio_max.item() == 1.0  # on-policy, at either level: exactly 1
    nan = algos.compute_policy_loss(
        torch.tensor([[0.0, math.nan]]),
        torch.zeros(1, 2),
        torch.ones(1, 2),
        torch.ones(1, 2),
        clip_low=0.2,
        clip_high=0.2,
    )
    assert math.isnan(nan.ratio_max.item())


def test_masked_max_and_min_ignore_padding_but_propagate_nan():
    x = torch.tensor([[1.0, -4.0, 9.0], [2.0, math.nan, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert algos.masked.masked_max(x, mask).item() == 2.0
    assert algos.masked.masked_min(x, mask).item() == -4.0
    mask[1, 1] = 1
    assert math.isnan(algos.masked.masked_max(x, mask).item()) and math.isnan(algos.masked.masked_min(x, mask).item())


def test_policy_loss_negative_advantage_clips_low():
    # ratio 0.5 with adv -1: unclipped 0.5, clipped -(-1)*0.8 = 0.8 -> loss 0.8, clipped
    lp = torch.tensor([[math.log(0.5)]])
    out = algos.compute_policy_loss(
        lp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), clip_low=0.2, clip_high=0.2, clip_c=None
    )
    pg_loss, clipfrac = out.pg_loss, out.pg_clipfrac
    assert pg_loss.item() == pytest.approx(0.8)
    assert clipfrac.item() == 1.0


def test_policy_loss_gradient_on_policy_is_minus_advantage():
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -1.5]])
    loss = algos.compute_policy_loss(lp, lp.detach(), adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.2).pg_loss
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


# -- verl-style API ---------------------------------------------------------------------------------------
# Shared tiny batch: B=4 sequences in G=2 groups, T=3, right padding. Padding holds junk (100, NaN) that
# must never show up in any result.
NAN = float("nan")
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 0, 0]])
TOKEN_REWARDS = torch.tensor(
    [
        [0.0, 0.0, 1.0],  # r = 1
        [0.0, 0.0, 100.0],  # r = 0 (100 is padding)
        [0.0, 2.0, NAN],  # r = 2
        [1.0, 100.0, NAN],  # r = 1
    ]
)


def outcome(name, token_rewards=TOKEN_REWARDS, mask=MASK, group_size=2, **kw):
    return algos.ADVANTAGES[name](algos.AdvantageInputs(token_rewards, mask, group_size, **kw))


def per_token(seq_adv, mask=MASK):
    """Broadcast hand-computed sequence advantages over the real tokens, 0 on padding."""
    return [[a if m else 0.0 for m in row] for a, row in zip(seq_adv, mask.tolist())]


def assert_2d(actual, expected, abs=1e-6):
    """A (B, T) tensor equals a nested list of hand-computed numbers (pytest.approx takes flat lists)."""
    assert list(actual.shape) == [len(expected), len(expected[0])]
    assert actual.flatten().tolist() == pytest.approx([x for row in expected for x in row], abs=abs)


def test_masked_whiten_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # mean 2, unbiased var ((1-2)^2 + 0 + (3-2)^2) / (3-1) = 1 -> (x - 2) / 1; padding 0 (its NaN ignored)
    assert algos.masked_whiten(x, mask)[0].tolist() == pytest.approx([-1.0, 0.0, 1.0, 0.0], abs=1e-6)
    # shift_mean=False adds the mean back: [1, 2, 3], padding still 0
    kept_mean = algos.masked_whiten(x, mask, shift_mean=False)
    assert kept_mean[0].tolist() == pytest.approx([1.0, 2.0, 3.0, 0.0], abs=1e-6)
    # one real position: variance taken as 0 -> the centred value 0, not verl's 0/0 NaN
    assert algos.masked_whiten(x, torch.tensor([[0, 1, 0, 0]]))[0].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert algos.masked_whiten(x, torch.zeros(1, 4)).tolist() == [[0.0] * 4]  # no real position: all 0


def test_scores_to_token_rewards_places_score_on_last_real_token():
    scores = torch.tensor([1.0, -2.0, 3.0, 4.0])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    # last real token: index 2, 1, 0; the fully padded row gets nothing
    expected = [[0.0, 0.0, 1.0], [0.0, -2.0, 0.0], [3.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert algos.scores_to_token_rewards(scores, mask).tolist() == expected
    assert algos.scores_to_token_rewards(torch.tensor([1, 2]), mask[:2]).dtype == torch.get_default_dtype()


def test_grpo_estimator_by_hand_with_padding():
    adv, ret = outcome("grpo", eps=1e-6)
    # r = [1, 0 | 2, 1]; each group: mean m, unbiased std sqrt(((.5)^2 + (.5)^2) / 1) = sqrt(.5)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # = 0.7071058
    assert_2d(adv, per_token([a, -a, a, -a]), abs=1e-6)
    assert ret is adv  # outcome estimators: returns == advantages


def test_grpo_estimator_tied_group_is_exactly_zero_and_group_of_one_as_verl():
    tr = torch.tensor([[0.0, 1.0], [1.0, NAN], [0.7, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv, _ = outcome("grpo", tr, mask)
    # group 1: r = [1, 1] (the second's NaN is padding) ties -> 0, no NaN; group 2: r = [.7, 0] ->
    # (.7 - .35) / (sqrt(2 * .35^2) + 1e-6) = +-.7071048
    a = 0.35 / (math.sqrt(2 * 0.35**2) + 1e-6)
    assert_2d(adv, [[0.0, 0.0], [0.0, 0.0], [a, a], [-a, -a]])
    # G = 1: verl uses mean 0, std 1 -> r / (1 + eps); drgrpo and rloo keep r itself
    adv1, _ = outcome("grpo", tr[:1], mask[:1], group_size=1, eps=1e-6)
    assert_2d(adv1, [[1 / (1 + 1e-6)] * 2])
    for name in ("drgrpo", "rloo"):
        assert_2d(outcome(name, tr[2:], mask[2:], group_size=1)[0], [[0.7, 0.7], [0.0, 0.0]])


def test_a_member_masked_whole_is_out_of_its_groups_baseline_spread_and_ties():
    """A multi-turn conversation masked whole (a tool's outage) has no real token: its group's baseline,
    std and ties are those of the present members (by hand), it gets no advantage, and another group with
    every member present keeps the plain formula exactly."""
    tr = torch.tensor([[1.0], [0.0], [0.0], [0.5], [1.0], [0.0], [0.0], [0.0]])
    mask = torch.tensor([[1], [1], [0], [1], [1], [1], [1], [1]])  # row 2 masked whole
    present = [0, 1, 3]  # group 1's members: rewards 1, 0, 0.5 (mean 0.5, unbiased std 0.5)
    full = {name: outcome(name, tr[4:], mask[4:], group_size=4)[0] for name in ("grpo", "drgrpo", "rloo")}
    grpo, _ = outcome("grpo", tr, mask, group_size=4, eps=1e-6)
    assert [grpo[i, 0].item() for i in present] == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert grpo[2, 0].item() == 0.0 and torch.equal(grpo[4:], full["grpo"])  # (0.5 / (0.5 + 1e-6) = 0.999998)
    drgrpo, _ = outcome("drgrpo", tr, mask, group_size=4)
    assert [drgrpo[i, 0].item() for i in present] == pytest.approx([0.5, -0.5, 0.0])
    assert torch.equal(drgrpo[4:], full["drgrpo"])
    rloo, _ = outcome("rloo", tr, mask, group_size=4)  # leave-one-out over the 3 present: (r - mean) * 3 / 2
    assert [rloo[i, 0].item() for i in present] == pytest.approx([0.75, -0.75, 0.0])
    assert torch.equal(rloo[4:], full["rloo"])
    tied = torch.tensor([[1.0], [1.0], [0.0], [1.0]])  # the present members tie: exactly 0, as a tied group
    assert outcome("grpo", tied, mask[:4], group_size=4)[0].abs().sum() == 0
    alone = torch.tensor([[1], [0], [0], [0]])  # one member present: no baseline to learn from
    assert outcome("grpo", tr[:4], alone, group_size=4)[0].abs().sum() == 0


def test_drgrpo_estimator_by_hand():
    adv, ret = outcome("drgrpo")
    # r - group mean: [1 - .5, 0 - .5 | 2 - 1.5, 1 - 1.5], no std
    assert_2d(adv, per_token([0.5, -0.5, 0.5, -0.5]))
    assert ret is adv


def test_rloo_estimator_by_hand():
    adv, _ = outcome("rloo")
    # G=2: A_i = r_i - r_other: [1 - 0, 0 - 1 | 2 - 1, 1 - 2]
    assert_2d(adv, per_token([1.0, -1.0, 1.0, -1.0]))
    # G=3, r = [1, 0, 0] (padding junk ignored): A_0 = 1 - mean(0, 0) = 1; A_1 = 0 - mean(1, 0) = -.5;
    # A_2 = -.5. Same as (r - 1/3) * 3/2.
    tr = torch.tensor([[0.0, 1.0], [0.0, 7.0], [0.0, NAN]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 0]])
    adv3, _ = outcome("rloo", tr, mask, group_size=3)
    assert_2d(adv3, per_token([1.0, -0.5, -0.5], mask))


def test_reinforce_plus_plus_baseline_estimator_by_hand():
    adv, ret = outcome("reinforce_plus_plus_baseline")
    # r - group mean = [.5, -.5, .5, -.5] on 3, 2, 2, 1 real tokens: 5 tokens of +.5, 3 of -.5.
    # whiten over the 8 real tokens: mean (5*.5 - 3*.5)/8 = .125; deviations .375 (x5), -.625 (x3);
    # unbiased var (5*.140625 + 3*.390625)/7 = 1.875/7 = .2678571, std .5175492
    hi, lo = 0.375 / math.sqrt(1.875 / 7), -0.625 / math.sqrt(1.875 / 7)  # 0.7245688, -1.2076147
    assert_2d(adv, per_token([hi, lo, hi, lo]), abs=1e-5)
    assert ret is adv


def test_reinforce_plus_plus_estimator_by_hand():
    adv, ret = outcome("reinforce_plus_plus", gamma=0.5)
    # G_t = r_t + .5 G_{t+1} over real tokens:
    # row 0 [0, 0, 1] -> [.25, .5, 1]; row 1 [0, 0] -> [0, 0]; row 2 [0, 2] -> [1, 2]; row 3 [1] -> [1]
    expected_ret = [[0.25, 0.5, 1.0], [0.0, 0.0, 0.0], [1.0, 2.0, 0.0], [1.0, 0.0, 0.0]]
    assert_2d(ret, expected_ret)
    # whiten the 8 real returns: mean 5.75/8 = .71875; sum of squared deviations 3.1796875; var /7
    mean, std = 0.71875, math.sqrt(3.1796875 / 7)  # std 0.6739741
    expected_adv = [
        [(g - mean) / std if m else 0.0 for g, m in zip(r, mk)] for r, mk in zip(expected_ret, MASK.tolist())
    ]
    assert_2d(adv, expected_adv, abs=1e-5)
    assert adv[0, 0].item() == pytest.approx(-0.6955015, abs=1e-5)  # (.25 - .71875) / .6739741


def test_gae_estimator_by_hand_with_right_padding():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 5.0]])  # 5.0 sits on padding
    values = torch.tensor([[0.5, 0.4, 0.6], [0.2, 0.3, NAN]])  # NaN value on padding
    adv, ret = algos.ADVANTAGES["gae"](algos.AdvantageInputs(rewards, mask, 1, values=values, gamma=0.9, lam=0.5))
    # row 0: d2 = 1 - .6 = .4, A2 = .4; d1 = 0 + .9*.6 - .4 = .14, A1 = .14 + .45*.4 = .32;
    #        d0 = .9*.4 - .5 = -.14, A0 = -.14 + .45*.32 = .004
    # row 1 (last real token t=1, V beyond it 0): d1 = 1 - .3 = .7, A1 = .7; d0 = .9*.3 - .2 = .07,
    #        A0 = .07 + .45*.7 = .385
    # returns = A + V: [.504, .72, 1.0], [.585, 1.0, pad 0]
    assert_2d(ret, [[0.504, 0.72, 1.0], [0.585, 1.0, 0.0]], abs=1e-6)
    # whiten A over the 5 real tokens: mean 1.809/5 = .3618; squared deviations sum .2461448; var /4 = .0615362
    std = math.sqrt(0.2461448 / 4)
    expected = [
        [(a - 0.3618) / std for a in (0.004, 0.32, 0.4)],
        [(0.385 - 0.3618) / std, (0.7 - 0.3618) / std, 0.0],
    ]
    assert_2d(adv, expected, abs=1e-5)
    assert adv[0, 0].item() == pytest.approx(-1.4423644, abs=1e-5)  # (.004 - .3618) / .2480649


def test_gae_needs_values_and_groups_must_divide_batch():
    with pytest.raises(ValueError, match="critic values"):
        outcome("gae")
    with pytest.raises(ValueError, match="does not split into groups of 3"):
        outcome("grpo", group_size=3)


def test_unknown_advantage_estimator_lists_valid_names():
    valid = "drgrpo, gae, grpo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo"
    with pytest.raises(KeyError, match=f"valid: {valid}"):
        algos.ADVANTAGES["ppo2"]


def test_policy_loss_clip_higher_is_asymmetric():
    # ratios: row 0 (A=+1) 1.25, 1.3; row 1 (A=-1) .75, .85; the third column is NaN padding
    lp = torch.tensor([[math.log(1.25), math.log(1.3), NAN], [math.log(0.75), math.log(0.85), NAN]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.28, clip_c=None)
    # clip range [.8, 1.28]: 1.25 stays (-1.25); 1.3 -> 1.28 (-1.28, clipped);
    # A=-1: max(.75, .8) = .8 (clipped); max(.85, .85) = .85 -> mean (-1.25 - 1.28 + .8 + .85) / 4 = -.22
    assert out.pg_loss.item() == pytest.approx(-0.22, abs=1e-6)
    assert out.pg_clipfrac.item() == pytest.approx(0.5)
    # ppo_kl = mean(old - new) = -(ln 1.25 + ln 1.3 + ln .75 + ln .85) / 4
    kl = -(math.log(1.25) + math.log(1.3) + math.log(0.75) + math.log(0.85)) / 4
    assert out.ppo_kl.item() == pytest.approx(kl, rel=1e-5)
    assert out.pg_clipfrac_lower.item() == 0.0
    # symmetric .2 for contrast: 1.25 now clips to 1.2 -> (-1.2 - 1.2 + .8 + .85) / 4 = -.1875, 3 of 4 clipped
    sym = algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=None)
    assert sym.pg_loss.item() == pytest.approx(-0.1875, abs=1e-6)
    assert sym.pg_clipfrac.item() == pytest.approx(0.75)


def test_policy_loss_dual_clip_value_and_gradient():
    # tokens: (ratio 5, A -1), (ratio 2, A -1), (ratio 5, A +1), (ratio 1, A -1); clip .2, clip_c 3
    lp = torch.tensor([[math.log(5.0), math.log(2.0), math.log(5.0), 0.0, NAN]], requires_grad=True)
    old = torch.zeros(1, 5)
    adv = torch.tensor([[-1.0, -1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    out = algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    # t0: max(5, 1.2) = 5, dual-capped at -A*3 = 3 -> 3 (dual active)
    # t1: max(2, 1.2) = 2 < 3 -> 2;  t2: max(-5, -1.2) = -1.2 (clipped, A>0 so no dual);  t3: max(1, 1) = 1
    # -> (3 + 2 - 1.2 + 1) / 4 = 1.2
    assert out.pg_loss.item() == pytest.approx(1.2, abs=1e-6)
    assert out.pg_clipfrac.item() == pytest.approx(0.25)  # only t2's clipped term is larger
    assert out.pg_clipfrac_lower.item() == pytest.approx(0.25)  # t0 of 4 real tokens
    out.pg_loss.backward()
    # d/dlp: t0 constant 3 -> 0; t1 loss = ratio -> ratio/4 = .5; t2 clipped -> 0; t3 ratio/4 = .25;
    # padding (NaN) -> exactly 0, not NaN
    assert lp.grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0, 0.25, 0.0], abs=1e-6)
    # without dual clip t0 keeps 5: (5 + 2 - 1.2 + 1) / 4 = 1.7
    plain = algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=None)
    assert plain.pg_loss.item() == pytest.approx(1.7, abs=1e-6)
    with pytest.raises(ValueError, match="clip_c must be > 1"):
        algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=1.0)


def test_policy_loss_token_level_gradient_on_policy():
    lp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    adv = torch.tensor([[0.5, -1.5, 9.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = algos.compute_policy_loss(lp, lp.detach(), adv, mask, clip_low=0.2, clip_high=0.28)
    out.pg_loss.backward()
    # ratio 1, nothing clipped: loss = mean(-A ratio), d/dlp = -A / 2 real tokens; padding 0
    assert lp.grad[0].tolist() == pytest.approx([-0.25, 0.75, 0.0])


def test_policy_loss_gspo_sequence_ratio_value_and_gradient():
    old = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]])
    diff = torch.tensor([[0.1, 0.2, 0.3], [-0.1, 0.05, NAN]])  # log pi - log pi_old; NaN on padding
    lp = (old + diff).detach().requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    out = algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, level="sequence")
    # row 0: s = exp(mean(.1, .2, .3)) = e^.2 = 1.2214 > 1.2 -> every token clipped: loss -1.2 each
    # row 1: s = exp(mean(-.1, .05)) = e^-.025 = .9753099, inside [.8, 1.2]: loss -2 * .9753099 each
    # aggregated as seq-mean-token-mean whatever agg_mode says (verl): (-1.2 + -1.9506198) / 2 = -1.5753099
    # (the token-mean over 5 tokens would be (3 * -1.2 + 2 * -1.9506198) / 5 = -1.5002479)
    assert out.pg_loss.item() == pytest.approx(-1.5753099, abs=1e-5)
    assert out.pg_clipfrac.item() == pytest.approx(3 / 5)  # all of row 0 (token level would clip 1 of 3)
    assert out.ppo_kl.item() == pytest.approx(-(0.1 + 0.2 + 0.3 - 0.1 + 0.05) / 5, abs=1e-6)  # -.11
    assert out.pg_clipfrac_lower.item() == 0.0  # no dual clip for GSPO
    out.pg_loss.backward()
    # d/dlp_t: row 0 clipped -> 0; row 1 each token -A s / (2 tokens * 2 sequences) = -2 * .9753099 / 4
    # = -.4876550 (the same for both tokens although their own ratios differ: the sequence ratio, each
    # token's own gradient path)
    expected = [[0.0, 0.0, 0.0], [-0.4876550, -0.4876550, 0.0]]
    assert_2d(lp.grad, expected, abs=1e-5)
    for mode in algos.AGG_MODES.names:  # loss_agg_mode plays no part in GSPO's policy loss
        other = algos.compute_policy_loss(
            lp, old, adv, mask, clip_low=0.2, clip_high=0.2, level="sequence", agg_mode=mode, horizon=7
        )
        assert other.pg_loss.item() == out.pg_loss.item(), mode
    assert algos.masked.policy_agg_mode("token-mean", "sequence") == "seq-mean-token-mean"
    assert algos.masked.policy_agg_mode("seq-mean-token-sum-norm", "token") == "seq-mean-token-sum-norm"
    with pytest.raises(KeyError, match="valid: token, sequence"):
        algos.compute_policy_loss(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, level="chunk")


def test_agg_loss_every_mode_with_padding():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, NAN], [6.0, NAN, 100.0], [7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the last row is all padding
    # token-mean: (1 + 2 + 3 + 4 + 5 + 6) / 6 = 3.5 (also the default mode)
    assert algos.agg_loss(loss, mask).item() == pytest.approx(3.5)
    assert algos.agg_loss(loss, mask, "token-mean").item() == pytest.approx(3.5)
    # seq-mean-token-sum: sums 6, 9, 6 over the 3 non-empty sequences -> 21 / 3 = 7
    assert algos.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(7.0)
    # seq-mean-token-mean: means 2, 4.5, 6 -> 12.5 / 3
    assert algos.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx(12.5 / 3)
    # seq-mean-token-sum-norm: the mean of the sums over the constant horizon. horizon 3: 2, 3, 2 -> 7/3
    # (verl <= 0.7.0 summed over sequences: 7); horizon 10: 6/10, 9/10, 6/10 -> mean .7
    assert algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", horizon=3).item() == pytest.approx(7 / 3)
    assert algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", horizon=10).item() == pytest.approx(0.7)
    # no default: the padded width (here 3) is the step's longest response, not a constant
    for horizon in (None, 0):
        with pytest.raises(ValueError, match=r"constant horizon > 0 \(rollout.max_new_tokens\)"):
            algos.agg_loss(loss, mask, "seq-mean-token-sum-norm", horizon=horizon)
    valid = "valid: token-mean, seq-mean-token-sum, seq-mean-token-mean, seq-mean-token-sum-norm"
    with pytest.raises(KeyError, match=valid):
        algos.agg_loss(loss, mask, "sum")


def test_value_loss_clipped_and_unclipped():
    values = torch.tensor([[0.5, 0.5, 0.0, NAN]])  # V at rollout
    vpreds = torch.tensor([[1.0, 0.6, -1.0, NAN]])
    returns = torch.tensor([[1.0, 0.0, 0.0, NAN]])
    mask = torch.tensor([[1, 1, 1, 0]])
    vf_loss, clipfrac = algos.compute_value_loss(vpreds, values, returns, mask, clip_range_value=0.2)
    # t0: clipped pred .5 + .2 = .7: (1 - 1)^2 = 0 vs (.7 - 1)^2 = .09 -> .09 (clipped term active)
    # t1: .6 within .5 +- .2: (.6 - 0)^2 = .36 both -> .36
    # t2: clipped pred -.2: (-1)^2 = 1 vs (-.2)^2 = .04 -> 1 (unclipped larger)
    # vf_loss = .5 * (.09 + .36 + 1) / 3 = .2416667; clipfrac 1/3
    assert vf_loss.item() == pytest.approx(0.5 * 1.45 / 3, abs=1e-6)
    assert clipfrac.item() == pytest.approx(1 / 3)


def test_seq_mean_token_sum_norm_divides_policy_and_value_losses_by_the_horizon_not_the_width():
    """The policy and value losses divide by the constant horizon (rollout.max_new_tokens) as the entropy and
    KL terms do, never by the batch's padded width (the step's longest response: 3 here)."""
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, NAN]])
    adv = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kw = {"clip_low": 0.2, "clip_high": 0.2, "agg_mode": "seq-mean-token-sum-norm"}
    out = algos.compute_policy_loss(lp, lp.detach(), adv, mask, **kw, horizon=8)
    # on-policy, ratio 1: token losses -A; sums -3 and -4, mean over 2 sequences -3.5, / 8 = -.4375
    # (the width 3 would give -1.1666667, 2.67x as large)
    assert out.pg_loss.item() == pytest.approx(-0.4375)
    with pytest.raises(ValueError, match="constant horizon"):
        algos.compute_policy_loss(lp, lp.detach(), adv, mask, **kw)
    vpreds = torch.tensor([[1.0, 0.0, 2.0], [0.5, 0.5, NAN]])
    returns = torch.tensor([[0.0, 0.0, 0.0], [1.5, 0.5, NAN]])
    vf_loss, clipfrac = algos.compute_value_loss(
        vpreds, vpreds.clone(), returns, mask, 0.2, "seq-mean-token-sum-norm", horizon=8
    )
    # nothing clipped (vpreds == values): squared errors 1 + 0 + 4 = 5 and 1 + 0 = 1; mean 3, / 8, * .5
    assert vf_loss.item() == pytest.approx(0.5 * 3 / 8)
    assert clipfrac.item() == 0.0


def test_value_clipfrac_is_zero_when_nothing_is_clipped():
    """vpreds inside [values - c, values + c] is not clipped, so it counts 0 however fp32 rounds: verl's
    clip_by_value returns vpreds itself, where values + clamp(vpreds - values) came back as 0.10000002
    for values .7, vpreds .1 (a larger loss than vpreds', counted as clipped)."""
    values, vpreds, returns = torch.tensor([[0.7]]), torch.tensor([[0.1]]), torch.tensor([[0.0]])
    assert (values + (vpreds - values).clamp(-10.0, 10.0)).item() != vpreds.item()  # the rounding
    vf_loss, clipfrac = algos.compute_value_loss(vpreds, values, returns, torch.ones(1, 1), clip_range_value=10.0)
    assert clipfrac.item() == 0.0
    assert vf_loss.item() == 0.5 * (vpreds - returns).square().item()  # .5 * .1^2 = .005, exactly the unclipped
    # clipping effectively off over many random tokens: 0 clipped, the loss exactly the unclipped one
    gen = torch.Generator().manual_seed(0)
    values, vpreds, returns = (torch.randn(64, 32, generator=gen) for _ in range(3))
    mask = torch.ones(64, 32)
    vf_loss, clipfrac = algos.compute_value_loss(vpreds, values, returns, mask, clip_range_value=1e3)
    assert clipfrac.item() == 0.0
    assert vf_loss.item() == (0.5 * algos.masked_mean((vpreds - returns).square(), mask)).item()
    # a value just inside the range keeps its own gradient; one outside is clipped to values + c
    vpreds = torch.tensor([[0.69, 1.5]], requires_grad=True)
    vf_loss, clipfrac = algos.compute_value_loss(
        vpreds, torch.tensor([[0.5, 0.5]]), torch.tensor([[0.0, 0.0]]), torch.ones(1, 2), clip_range_value=0.2
    )
    # t0 inside: .69^2 both; t1: max(1.5^2, .7^2) = 2.25 unclipped; nothing counts as clipped
    assert vf_loss.item() == pytest.approx(0.5 * (0.69**2 + 2.25) / 2)
    assert clipfrac.item() == 0.0
    vf_loss.backward()
    assert vpreds.grad[0].tolist() == pytest.approx([0.69 / 2, 1.5 / 2])  # d/dv .5 mean(v^2) = v / 2


def _rank_batch(mask: torch.Tensor) -> Sequences:
    """A rank's batch of responses ``mask`` (B, T) after a one-token prompt each."""
    prompt = torch.ones(mask.shape[0], 1, dtype=torch.long)
    return Sequences(torch.cat([prompt, mask], 1), torch.cat([prompt, mask], 1), mask, 1)


def _split(loss, mask, mode, world: int, micro: int | None, horizon: int, max_tokens: int | None = None) -> float:
    """``mode``'s loss of the (B, T) batch as DeepSpeed sums it when ``world`` ranks each take B / world rows
    in micro-batches (``microbatch.plan``: ``micro`` rows each, or by a ``max_tokens`` budget): each
    micro-batch's loss on its own columns times its weight, divided by the micro-batches the weights
    count (``pieces``, as the backward divides), summed, and averaged over ranks (DeepSpeed's averaging).
    The ranks' collectives are played from the whole batch: the sum of tokens and of rows over ranks,
    and the largest micro-batch count any rank needs."""
    per_rank = mask.shape[0] // world
    shares = [slice(r * per_rank, (r + 1) * per_rank) for r in range(world)]
    counts = [
        len(microbatch.by_tokens(microbatch.lengths(_rank_batch(mask[s])), 0, per_rank, max_tokens or 1))
        for s in shares
    ]
    total = 0.0
    for rows in shares:
        sums = iter([int(mask.sum()), mask.shape[0]])  # plan asks for the tokens, then the rows
        plans = microbatch.plan(
            _rank_batch(mask[rows]),
            per_rank,
            micro_batch=micro,
            max_tokens=max_tokens,
            world=world,
            total=lambda _n, sums=sums: next(sums),
            most=lambda _n: max(counts),
        )
        for mb in [mb for mbs in plans for mb in mbs]:
            piece = algos.agg_loss(mb.tokens(loss[rows]), mb.tokens(mask[rows]), mode, horizon)
            total += mb.weight(mode) * piece.item() / mb.pieces
    return total / world


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_and_ranks_weighted_give_the_whole_batch_loss(mode):
    """2 ranks x 2 micro-batches of 2 sequences, of 1 to 4 tokens each, and micro-batches by token budgets
    (sorted by length, of 1 to 4 rows, cut to their own columns, as many on each rank): weighted as
    ``microbatch.plan`` weighs them, the pieces add up to the loss of the whole batch, in every mode; and the actor's GSPO loss (its
    policy term a sequence mean, its KL term by loss_agg_mode) too, each term with its own weight."""
    loss = torch.arange(1.0, 33.0).view(8, 4)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]] * 2)
    mask[4:] = mask[4:].flip(0)  # the ranks' micro-batches hold 5, 5 and 7, 3 tokens
    whole = algos.agg_loss(loss, mask, mode, horizon=6).item()
    assert _split(loss, mask, mode, world=2, micro=2, horizon=6) == pytest.approx(whole, rel=1e-6)
    assert _split(loss, mask, mode, world=1, micro=2, horizon=6) == pytest.approx(whole, rel=1e-6)
    for budget in (1, 6, 10, 15, 40):  # token budgets: 1-4 micro-batches of 1-4 rows, trimmed columns
        assert _split(loss, mask, mode, 2, None, 6, max_tokens=budget) == pytest.approx(whole, rel=1e-6)
        assert _split(loss, mask, mode, 1, None, 6, max_tokens=budget) == pytest.approx(whole, rel=1e-6)
    pg_mode = algos.masked.policy_agg_mode(mode, "sequence")
    gspo = _split(loss, mask, pg_mode, 2, 2, 6) + 0.1 * _split(loss.sqrt(), mask, mode, 2, 2, 6)
    expected = algos.agg_loss(loss, mask, pg_mode) + 0.1 * algos.agg_loss(loss.sqrt(), mask, mode, horizon=6)
    assert gspo == pytest.approx(expected.item(), rel=1e-6)


def test_apply_kl_penalty_by_hand():
    old = torch.tensor([[-1.0, -2.0, NAN], [-1.0, NAN, NAN]])
    ref = torch.tensor([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rewards = torch.tensor([[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]])
    out, kl = algos.apply_kl_penalty(rewards, old, ref, mask, beta=0.1, estimator="k1")
    # k1 = old - ref: row 0 [.5, -1], row 1 [-.5]; rewards - .1 k1: [-.05, 1.1, 0], [2.05, 0, 0]
    assert_2d(out, [[-0.05, 1.1, 0.0], [2.05, 0.0, 0.0]], abs=1e-6)
    # per-sequence means (.5 - 1)/2 = -.25 and -.5 -> mean over sequences -.375
    assert kl == pytest.approx(-0.375)
    # k2 = .5 (old - ref)^2: [.125, .5] mean .3125, [.125] -> (.3125 + .125) / 2 = .21875
    _, kl2 = algos.apply_kl_penalty(rewards, old, ref, mask, beta=0.1, estimator="k2")
    assert kl2 == pytest.approx(0.21875)


def test_adaptive_kl_controller_update_sequence():
    ctrl = algos.AdaptiveKLController(kl_coef=0.05, target_kl=0.1, horizon=100)
    ctrl.update(current_kl=0.3, n_steps=10)
    # error = clip(.3/.1 - 1 = 2, -.2, .2) = .2 -> x (1 + .2 * 10/100) = x1.02 -> .051
    assert ctrl.value == pytest.approx(0.051)
    ctrl.update(current_kl=0.05, n_steps=10)
    # error = clip(.5 - 1, ...) = -.2 -> x.98 -> .04998
    assert ctrl.value == pytest.approx(0.04998)
    ctrl.update(current_kl=0.11, n_steps=50)
    # error = .1 (inside the clip) -> x(1 + .1 * 50/100) = x1.05 -> .052479
    assert ctrl.value == pytest.approx(0.052479)


def test_kl_controllers_round_trip_and_refuse_the_other_type():
    ctrl = algos.AdaptiveKLController(0.05, 0.1, 100)
    ctrl.update(0.3, 10)
    state = ctrl.state_dict()
    expected = {"version": 1, "type": "adaptive", "value": pytest.approx(0.051), "target_kl": 0.1, "horizon": 100}
    assert state == expected
    other = algos.AdaptiveKLController(0.05, 0.1, 100)
    other.load_state_dict(state)
    assert other.value == pytest.approx(0.051)
    with pytest.raises(ValueError, match="type 'adaptive'.*'fixed'"):
        algos.FixedKLController(0.05).load_state_dict(state)
    with pytest.raises(ValueError, match="type 'fixed'.*'adaptive'"):
        other.load_state_dict(algos.FixedKLController(0.05).state_dict())
    with pytest.raises(ValueError, match="version 2"):
        other.load_state_dict({**state, "version": 2})


def test_make_kl_controller():
    assert isinstance(algos.make_kl_controller("fixed", 0.05, None, None), algos.FixedKLController)
    ada = algos.make_kl_controller("adaptive", 0.05, 0.1, 100)
    assert isinstance(ada, algos.AdaptiveKLController)
    assert (ada.value, ada.target_kl, ada.horizon) == (0.05, 0.1, 100)
    with pytest.raises(ValueError, match="needs target_kl and horizon"):
        algos.make_kl_controller("adaptive", 0.05, None, 100)
    with pytest.raises(ValueError, match="horizon > 0"):
        algos.make_kl_controller("adaptive", 0.05, 0.1, 0)
    with pytest.raises(KeyError, match="valid: adaptive, fixed"):
        algos.make_kl_controller("pid", 0.05, 0.1, 100)


def test_tied_groups():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5])
    # groups of 2: (1, 1) tie, (0, 1) not, (.5, .5) tie
    assert algos.tied_groups(scores, 2).tolist() == [True, False, True]
    # groups of 3: (1, 1, 0) not, (1, .5, .5) not
    assert algos.tied_groups(scores, 3).tolist() == [False, False]


def test_overlong_penalty_three_zones():
    lengths = torch.tensor([10, 16, 18, 20, 25])
    # max_len 20, buffer 4 -> free up to 16; factor .5
    # 10, 16 -> 0; 18 -> (16 - 18)/4 * .5 = -.25; 20 -> (16 - 20)/4 * .5 = -.5; 25 (beyond) -> -.5
    out = algos.overlong_penalty(lengths, max_len=20, buffer_len=4, factor=0.5)
    assert out.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="buffer_len"):
        algos.overlong_penalty(lengths, max_len=20, buffer_len=0)


def test_everything_exported():
    for name in algos.__all__:
        assert hasattr(algos, name), name
