import pytest

from rlctl.engine.reward import load_reward_fn
from rlctl.engine.reward.builtin import echo_reward, echo_score, make_prompts
from rlctl.engine.reward.gsm8k import exact_match, extract_final_number
from rlctl.errors import ConfigError


def test_echo_score_partial_credit():
    assert echo_score("abc", "abc") == 1.0
    assert echo_score("abc", "") == 0.0
    assert echo_score("abc", "cab") == pytest.approx(0.5)  # all letters right, none in place
    assert echo_score("abc", "axx") == pytest.approx(0.5 * 1 / 3 + 0.5 * 1 / 3)
    assert echo_score("ab", "abab") == pytest.approx(0.5)  # right, then rambles: scaled by 2/4


def test_echo_reward_reads_target_column_or_prompt():
    assert echo_reward(["ab=", "cd="], ["ab", "dc"]) == [1.0, 0.5]
    assert echo_reward(["ignored", "x"], ["ab", "ab"], target=["ab", "ba"]) == [1.0, 0.5]


def test_make_prompts_is_seeded():
    assert make_prompts(5, 1) == make_prompts(5, 1)
    assert make_prompts(5, 1) != make_prompts(5, 2)
    assert all(r["prompt"] == r["target"] + "=" for r in make_prompts(50, 0))


@pytest.mark.parametrize(
    "text,number",
    [
        ("so the answer is 42.", "42"),
        ("#### 1,234", "1234"),
        ("3 apples and 4 pears #### 7", "7"),
        ("-5.0 degrees", "-5"),
        ("0.25 of it", "0.25"),
        ("no number here", None),
    ],
)
def test_gsm8k_extraction(text, number):
    assert extract_final_number(text) == number


def test_gsm8k_exact_match():
    answers = ["Natalia sold 48/2 = 24 clips in May.\n#### 72", "72", "72"]
    completions = ["She sold 72 clips in total. #### 72", "It is 71", "I don't know"]
    assert exact_match(["q"] * 3, completions, answer=answers) == [1.0, 0.0, 0.0]
    assert exact_match(["q"] * 3, completions, answer=answers, format_score=0.1) == [1.0, 0.1, 0.0]


def test_load_reward_fn_errors_name_the_key():
    assert load_reward_fn("rlctl.engine.reward.gsm8k:exact_match") is exact_match
    with pytest.raises(ConfigError, match="'reward.function': cannot import module 'no_such_mod'"):
        load_reward_fn("no_such_mod:f")
    with pytest.raises(ConfigError, match="has no function 'nope'.*exact_match"):
        load_reward_fn("rlctl.engine.reward.gsm8k:nope")
