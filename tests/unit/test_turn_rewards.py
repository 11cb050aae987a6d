"""Per-turn rewards from a reward function (a multi-turn rollout's): an item {"score": s, "turns": [...]}
gives the completion's score and its turns' rewards, weighted and summed over reward sources; they sit on
the model's turns' last tokens, and a malformed item or more rewards than turns is an InputError."""

import pytest
import torch

from rlctl.engine.reward import check_scores
from rlctl.engine.reward.sources import RewardSources, Source, recording
from rlctl.engine.rollout.conversation import turn_reward_tensor
from rlctl.errors import InputError


def test_an_item_may_carry_its_turns_rewards_where_the_rollout_has_turns():
    turns = [None] * 3
    assert check_scores("m:f", [1, {"score": 0.5, "turns": [0.25, -1]}, {"score": 2}], 3, turns=turns) == [
        1.0,
        0.5,
        2.0,
    ]
    assert turns == [None, [0.25, -1.0], []]
    with pytest.raises(InputError, match=r"need rollout.multi_turn"):
        check_scores("m:f", [{"score": 1, "turns": [1]}], 1)  # a single-turn rollout
    for bad in (
        {"turns": [1]},
        {"score": 1, "turns": [float("nan")]},
        {"score": 1, "turn": [1]},
        {"score": 1, "turns": 3},
    ):
        with pytest.raises(InputError, match=r"completion 0; expected a number or \{'score': number, 'turns'"):
            check_scores("m:f", [bad], 1, turns=[None])


def test_sources_weigh_and_sum_their_turns_rewards_and_record_them():
    a = Source("a", 2.0, lambda p, c, **kw: [{"score": 1.0, "turns": [0.5]}, 0.0], "a:f")
    b = Source("b", 1.0, lambda p, c, **kw: [{"score": 0.0, "turns": [1.0, 1.0]}, 1.0], "b:f")
    reward, turns = RewardSources([a, b], per_source=True), [None, None]
    with recording(reward) as means:
        assert reward.score_batch(["p", "q"], ["x", "y"], {}, turns) == [2.0, 1.0]
    assert turns == [[2.0, 1.0], None]  # 2 x 0.5 + 1, then 0 + 1
    assert means == {"critic/score/a/mean": 0.75, "critic/score/b/mean": 1.5}  # each source's own total


def test_turn_rewards_sit_on_their_turns_last_tokens():
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    placed = turn_reward_tensor([[0.5, 1.0], [2.0], [3.0]], [[1, 5], [None], [0]], mask, "reward function 'm:f'")
    assert placed.tolist() == [[0, 0.5, 0, 0, 0, 1.0], [0, 0, 2.0, 0, 0, 0], [0] * 6]  # masked whole: none
    with pytest.raises(InputError, match=r"'m:f' gave completion 0 3 turn rewards, but its conversation has 2"):
        turn_reward_tensor([[1, 2, 3]], [[1, 5]], mask[:1], "reward function 'm:f'")
