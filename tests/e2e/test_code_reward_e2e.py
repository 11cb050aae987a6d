"""A code-reward run through the real CLI: the built-in model trains on the coding example's problems
(examples/data/coding_train.jsonl) scored by ``tests_passed`` in the jail. The model cannot write code,
so every test fails; the point is the rows: reward/code/* there, reduced as declared, with the number of
tests the drawn problems hold (3 each, fizzbuzz 2), no pass and no timeout, and the jails' seconds."""

import pytest

from rlctl.sandbox import Limits, SandboxUnavailable, check

from helpers import REPO, invoke, metrics_of, start_args

try:
    check(Limits(), "sandbox")
    problem = None
except SandboxUnavailable as exc:
    problem = str(exc)
pytestmark = pytest.mark.skipif(problem is not None, reason=f"no bubblewrap jail on this machine: {problem}")


def test_a_code_reward_run_writes_its_tests_passes_timeouts_and_sandbox_seconds(tmp_path):
    config = {
        "data": {"path": str(REPO / "examples" / "data" / "coding_train.jsonl"), "max_prompt_length": 512},
        "reward": {
            "function": "rlctl.engine.reward.code:tests_passed",
            "kwargs": {"workers": 2, "sandbox": {"wall_time_s": 30, "cpu_time_s": 10}},
        },
        "trainer": {"total_steps": 2, "prompts_per_step": 2},
        "algorithm": {"group_size": 2},
        "rollout": {"max_new_tokens": 8},
    }
    # (limits far above what 8 tokens of the model's code can use: a jail that starts slowly on a loaded
    # machine, 3 s of wall time in a suite of 3 workers on 2 cores, is no timeout of the code's own)
    run = tmp_path / "run"
    r = invoke("start", *start_args(run, config=config), cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert len(rows) == 2
    for row in rows:
        assert row["reward/code/tests"] in (10, 12)  # 2 problems x 2 answers x (3 or 2) tests
        assert row["reward/code/pass_frac"] == 0 == row["critic/score/mean"]
        assert row["reward/code/timeouts"] == 0
        assert 0 < row["reward/code/sandbox_s"] < 60
