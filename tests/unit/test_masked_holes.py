"""Responses with holes (the tool and template tokens of a multi-turn conversation, masked out): every
advantage estimator treats a hole as if it were cut out of the row, REINFORCE++ carries its running return
across one (current verl), and a row whose every token is masked adds nothing to the policy loss, the KL,
the entropy or their normalisation, and never yields a NaN (nor a NaN gradient)."""

import pytest
import torch

from rlctl import algos

NAN = float("nan")
# rows of groups of 2; holes inside rows 0, 1 and 3, row 2 without one
MASK = torch.tensor(
    [
        [1, 1, 0, 0, 1, 1, 0],
        [1, 0, 0, 1, 0, 0, 0],
        [1, 1, 1, 1, 1, 0, 0],
        [1, 0, 1, 0, 1, 0, 1],
    ]
)


def compact(x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's real positions moved to its front, in order (the row with its holes cut out)."""
    out, cmask = torch.zeros_like(x), torch.zeros_like(mask)
    for i in range(len(x)):
        real = x[i][mask[i].bool()]
        out[i, : len(real)], cmask[i, : len(real)] = real, 1
    return out, cmask


def inputs(mask: torch.Tensor, rewards: torch.Tensor, values: torch.Tensor, **kw) -> algos.AdvantageInputs:
    return algos.AdvantageInputs(rewards, mask, group_size=2, values=values, gamma=kw.get("gamma", 0.9), lam=0.8)


@pytest.mark.parametrize("estimator", algos.ADVANTAGES.names)
def test_every_estimator_treats_a_hole_as_cut_out(estimator):
    torch.manual_seed(0)
    scores = torch.tensor([1.0, 0.0, 0.5, 2.0])
    rewards = algos.scores_to_token_rewards(scores, MASK) + 0.1 * torch.randn(MASK.shape) * MASK  # a KL penalty too
    values = torch.randn(MASK.shape)
    junk = ~MASK.bool()
    rewards, values = rewards.masked_fill(junk, NAN), values.masked_fill(junk, NAN)  # holes hold garbage
    adv, ret = algos.ADVANTAGES[estimator](inputs(MASK, rewards, values))
    (c_rewards, cmask), (c_values, _) = compact(rewards, MASK), compact(values, MASK)
    c_adv, c_ret = algos.ADVANTAGES[estimator](inputs(cmask, c_rewards, c_values))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[junk] == 0).all() and (ret[junk] == 0).all()
    assert torch.allclose(compact(adv, MASK)[0], c_adv, atol=1e-6)
    assert torch.allclose(compact(ret, MASK)[0], c_ret, atol=1e-6)
    assert not torch.allclose(c_adv, torch.zeros_like(c_adv))  # (something to compare)


def test_reinforce_plus_plus_carries_its_return_across_a_hole():
    mask = torch.tensor([[1, 0, 0, 1, 0], [1, 1, 1, 1, 0]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 3.0, 0.0]])
    _, ret = algos.ADVANTAGES["reinforce_plus_plus"](algos.AdvantageInputs(rewards, mask, 1, gamma=0.5))
    # row 0: the return of the last model token (1) reaches the first through the tool's tokens, once
    # discounted (the hole is no step); restarting at the hole (rlctl before) gave 0 there
    assert ret[0].tolist() == [0.5, 0.0, 0.0, 1.0, 0.0]
    assert ret[1].tolist() == [0.375, 0.75, 1.5, 3.0, 0.0]


def test_gae_skips_a_hole():
    mask = torch.tensor([[1, 0, 1]])
    rewards, values = torch.tensor([[0.0, 9.0, 1.0]]), torch.tensor([[0.5, 7.0, 0.6]])
    _, ret = algos.ADVANTAGES["gae"](algos.AdvantageInputs(rewards, mask, 1, values=values, gamma=0.9, lam=0.5))
    # as the row [0.5, 0.6] without the hole: A1 = 1 - .6 = .4, A0 = .9*.6 - .5 + .45*.4 = .22
    assert ret[0].tolist() == pytest.approx([0.22 + 0.5, 0.0, 1.0])


MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("mode", MODES)
def test_an_all_masked_row_adds_nothing_and_never_a_nan(mode, level):
    torch.manual_seed(1)
    B, T = 4, 6
    mask = torch.tensor([[1, 1, 0, 0, 1, 0], [0] * 6, [1, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    log_prob = (torch.randn(B, T) - 1).requires_grad_()
    old = log_prob.detach() + 0.1 * torch.randn(B, T)
    adv = torch.randn(B, T)
    with torch.no_grad():  # garbage wherever the mask is 0: tool tokens and the fully masked row
        log_prob[~mask.bool()] = NAN
        old[1] = -float("inf")
    pl = algos.compute_policy_loss(
        log_prob, old, adv, mask, clip_low=0.2, clip_high=0.2, agg_mode=mode, level=level, horizon=T
    )
    keep = torch.tensor([0, 2, 3])
    ref = algos.compute_policy_loss(
        log_prob[keep],
        old[keep],
        adv[keep],
        mask[keep],
        clip_low=0.2,
        clip_high=0.2,
        agg_mode=mode,
        level=level,
        horizon=T,
    )
    assert torch.isfinite(pl.pg_loss) and pl.pg_loss.item() == pytest.approx(ref.pg_loss.item(), rel=1e-6)
    assert pl.ppo_kl.item() == pytest.approx(ref.ppo_kl.item(), rel=1e-6)
    pl.pg_loss.backward()
    assert torch.isfinite(log_prob.grad).all() and (log_prob.grad[~mask.bool()] == 0).all()
    ref_lp = log_prob.detach() - 0.3
    kl = algos.kl_penalty(log_prob.detach(), ref_lp, "k3")
    entropy = torch.rand(B, T).masked_fill(~mask.bool(), NAN)
    for term in (kl, entropy):
        whole = algos.agg_loss(term, mask, mode, horizon=T)
        assert torch.isfinite(whole) and whole.item() == pytest.approx(
            algos.agg_loss(term[keep], mask[keep], mode, horizon=T).item()
        )


def test_a_batch_of_only_masked_rows_gives_zero_not_nan():
    mask = torch.zeros(2, 3, dtype=torch.long)
    lp = torch.zeros(2, 3, requires_grad=True)
    for mode in MODES:
        pl = algos.compute_policy_loss(
            lp, lp.detach(), torch.ones(2, 3), mask, clip_low=0.2, clip_high=0.2, agg_mode=mode, horizon=3
        )
        assert pl.pg_loss.item() == 0.0
    adv, ret = algos.ADVANTAGES["grpo"](
        algos.AdvantageInputs(algos.scores_to_token_rewards(torch.ones(2), mask), mask, 2)
    )
    assert (adv == 0).all() and (ret == 0).all()
    assert algos.masked_whiten(torch.ones(2, 3), mask).eq(0).all()
