import math
import re
import signal
import sys
import textwrap
import threading

import numpy as np
import pytest

from rlctl.engine.reward import check_scores, load_reward_fn, score_completions
from rlctl.engine.reward.builtin import echo_reward, echo_score, make_prompts
from rlctl.engine.reward.gsm8k import exact_match, extract_final_number
from rlctl.errors import ConfigError, ExitCode, InputError


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


# --------------------------------------------------------------------------------------------------
# User code is untrusted: its import, its call and its result


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Write a real module into tmp_path and make it importable; returns a writer: (name, source)."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    for name in written:
        sys.modules.pop(name, None)


@pytest.mark.parametrize(
    "source,cause",
    [
        ("def f(prompts, completions:\n    pass\n", r"SyntaxError: .* \(.*syn_mod\.py:1\)"),
        ("raise RuntimeError('no GPU key')\n", r"RuntimeError: no GPU key \(.*syn_mod\.py:1\)"),
        ("import sys\nsys.exit(0)\n", r"SystemExit\(0\) \(.*syn_mod\.py:2\)"),
        ("raise KeyboardInterrupt\n", r"KeyboardInterrupt \(.*syn_mod\.py:1\)"),
        (
            "import no_such_dependency_xyz\n",
            r"ModuleNotFoundError: No module named 'no_such_dependency_xyz' \(.*syn_mod\.py:1\)",
        ),
    ],
)
def test_a_module_that_fails_to_import_is_an_input_error(user_module, source, cause):
    user_module("syn_mod", source)
    with pytest.raises(InputError) as err:
        load_reward_fn("syn_mod:f")
    assert re.fullmatch(rf"reward function 'syn_mod:f': importing module 'syn_mod' raised {cause}", err.value.message)
    assert err.value.exit_code == ExitCode.INPUT


def test_a_missing_module_or_function_stays_a_config_error(user_module):
    user_module("has_g", "def g(prompts, completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(ConfigError, match="module 'has_g' has no function 'f' \\(it has: g\\)"):
        load_reward_fn("has_g:f")
    with pytest.raises(ConfigError, match="cannot import module 'pkg_absent.sub'"):
        load_reward_fn("pkg_absent.sub:f")
    user_module("not_callable", "f = 3\n")
    with pytest.raises(ConfigError, match="has no function 'f'"):
        load_reward_fn("not_callable:f")


@pytest.mark.parametrize(
    "body,cause",
    [
        ("raise ValueError('bad\\n  row')", r"ValueError: bad row \(.*raising\.py:\d+\)"),
        ("raise SystemExit(0)", r"SystemExit\(0\) \(.*raising\.py:\d+\)"),
        ("exit(3)", r"SystemExit\(3\) \(.*raising\.py:\d+\)"),
        ("raise KeyboardInterrupt", r"KeyboardInterrupt \(.*raising\.py:\d+\)"),
        ("raise GeneratorExit", r"GeneratorExit \(.*raising\.py:\d+\)"),
        ("raise StopIteration", r"StopIteration \(.*raising\.py:\d+\)"),
    ],
)
def test_anything_the_reward_raises_or_exits_with_is_an_input_error(user_module, body, cause):
    user_module("raising", f"def f(prompts, completions, **kw):\n    {body}\n")
    fn = load_reward_fn("raising:f")
    with pytest.raises(InputError) as err:
        score_completions(fn, "raising:f", ["p"], ["c"], {}, {})
    assert re.fullmatch(rf"reward function 'raising:f' raised {cause}", err.value.message), err.value.message
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is put back


def test_a_real_ctrl_c_during_the_reward_stays_an_interrupt(user_module):
    """SIGINT arrives while the reward runs: KeyboardInterrupt (exit 130), not an InputError."""
    user_module(
        "slow",
        """
        import os, signal, time
        def f(prompts, completions, **kw):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
            return [0.0] * len(completions)
        """,
    )
    fn = load_reward_fn("slow:f")
    with pytest.raises(KeyboardInterrupt):
        score_completions(fn, "slow:f", ["p"], ["c"], {}, {})
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_stop_signal_during_the_reward_import_is_a_stop_not_the_code_s_fault(user_module):
    """Before training, rlctl raises Stopped on SIGTERM; the reward module being imported then must
    not turn it into exit 4."""
    from rlctl.errors import Stopped

    user_module("stopping", "from rlctl.errors import Stopped\nraise Stopped('SIGTERM')\ndef f(p, c, **kw): pass\n")
    with pytest.raises(Stopped):
        load_reward_fn("stopping:f")


def test_a_ctrl_c_is_ignored_where_it_was_ignored_before(user_module):
    user_module(
        "ignored",
        """
        import os, signal
        def f(prompts, completions, **kw):
            os.kill(os.getpid(), signal.SIGINT)
            return [1.0] * len(completions)
        """,
    )
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert score_completions(load_reward_fn("ignored:f"), "ignored:f", ["p"], ["c"], {}, {}) == [1.0]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_off_the_main_thread_a_raised_keyboard_interrupt_is_the_reward_s(user_module):
    user_module("kbd", "def f(prompts, completions, **kw):\n    raise KeyboardInterrupt\n")
    fn, caught = load_reward_fn("kbd:f"), []

    def run():
        try:
            score_completions(fn, "kbd:f", ["p"], ["c"], {}, {})
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert isinstance(caught[0], InputError) and "raised KeyboardInterrupt" in caught[0].message


def gen_scores(n):
    return (0.5 for _ in range(n))


@pytest.mark.parametrize(
    "result,message",
    [
        (gen_scores(4), "returned a generator; expected a list of 4 finite numbers, one per completion"),
        ("abcd", "returned 'abcd'; expected a list of 4 finite numbers"),
        (0.5, "returned 0.5; expected a list"),
        (None, "returned None; expected a list"),
        ({0: 1.0}, "returned a dict; expected a list"),
        ({1.0, 2.0, 3.0, 4.0}, "returned a set; expected a list"),
        (np.zeros((2, 2)), "returned a 2-d array; expected a list"),
        ([1.0, 2.0], "returned 2 scores for 4 completions"),
        ([1.0, 0.0, 0.0, "abc"], "returned 'abc' for completion 3; expected one finite number per completion"),
        ([1.0, None, 0.0, 0.0], "returned None for completion 1;"),
        ([1.0, float("nan"), 0.0, 0.0], "returned nan for completion 1;"),
        ([1.0, 0.0, -math.inf, 0.0], "returned -inf for completion 2;"),
        ([1e39, 0.0, 0.0, 0.0], "returned 1e+39 for completion 0;"),
        ([1.0, 0.0, 0.0, 1j], "returned 1j for completion 3;"),
        ([[1.0], 0.0, 0.0, 0.0], "returned [1.0] for completion 0;"),
        (np.array([0.0, np.nan, 0.0, 0.0]), "returned nan for completion 1;"),
    ],
)
def test_a_result_that_is_not_one_finite_number_per_completion_is_named(result, message):
    with pytest.raises(InputError) as err:
        check_scores("mymod:score", result, 4)
    assert err.value.message.startswith("reward function 'mymod:score' ")
    assert message in err.value.message


def test_numbers_of_every_kind_are_accepted_as_floats():
    import torch

    ok = [
        [1, 0.5, True, np.float32(0.25)],
        (1, 0.5, True, 0.25),
        np.array([1, 0.5, 1, 0.25], dtype=np.float32),
        torch.tensor([1.0, 0.5, 1.0, 0.25]),
        [torch.tensor(1.0), np.float64(0.5), np.bool_(True), np.int64(0) + 0.25],
    ]
    for scores in ok:
        got = check_scores("m:f", scores, 4)
        assert got == [1.0, 0.5, 1.0, 0.25] and all(type(x) is float for x in got)


def test_builtin_rewards_go_through_the_same_check():
    prompts, completions = ["ab="] * 2, ["ab", "x"]
    assert score_completions(echo_reward, "rlctl.engine.reward.builtin:echo_reward", prompts, completions, {}, {}) == [
        1.0,
        0.0,
    ]
    scores = score_completions(
        exact_match, "rlctl.engine.reward.gsm8k:exact_match", ["q"] * 2, ["#### 7", "8"], {"answer": ["7", "7"]}, {}
    )
    assert scores == [1.0, 0.0]


def test_experience_scores_through_the_check(user_module):
    """The trainer's scoring phase: a float32 tensor of the scores, or the InputError."""
    import torch

    from rlctl.config import RunConfig
    from rlctl.engine.experience import Experience

    user_module("strs", "def f(prompts, completions, **kw):\n    return [str(len(c)) for c in completions]\n")
    cfg = RunConfig(reward={"function": "strs:f"})
    exp = Experience(cfg, None, None, load_reward_fn("strs:f"), 0, None)
    with pytest.raises(InputError, match=r"reward function 'strs:f' returned '2' for completion 0"):
        exp.score(["p", "p"], ["ab", "c"], {})
    exp = Experience(RunConfig(), None, None, echo_reward, 0, None)
    scores = exp.score(["ab=", "ab="], ["ab", "ba"], {})
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.5]
