"""A reward model drives a real run: `rlctl start` with `reward.sources` = the built-in echo reward and a
tiny Llama sequence classifier saved here; the rows carry each source's mean and the model's truncated
fraction, the step's score is their weighted sum, and a run killed with SIGKILL and resumed ends with the
same rows and weights as an uninterrupted one (the reward model scores alike after a restart)."""

import json

import pytest

from helpers import (
    REPO,
    SMALL,
    completed_hash,
    invoke,
    kill_and_resume,
    metrics_of,
    save_reward_model,
    stable,
    start_args,
)


def test_a_reward_model_source_drives_a_run_and_resumes_exactly(tmp_path):
    rm = save_reward_model(tmp_path / "tiny-rm", context=8)  # shorter than prompt + completion: some are cut
    cfg = {
        "trainer": {"total_steps": 5},
        "checkpoint": {"every": 2},
        "reward": {
            "sources": [
                {"function": "rlctl.engine.reward.builtin:echo_reward", "weight": 1.0},
                {"model": {"path": str(rm), "batch_size": 4}, "weight": 0.1},
            ]
        },
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(cfg))
    args = [str(path), *SMALL]

    ref = tmp_path / "ref"
    done = invoke("start", *start_args(ref, config=path), *SMALL, cwd=REPO)
    assert done.returncode == 0, done.stderr
    rows = metrics_of(ref)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    for row in rows:
        echo, model = row["critic/score/echo_reward/mean"], row["critic/score/tiny-rm/mean"]
        assert row["critic/score/mean"] == pytest.approx(echo + 0.1 * model, abs=1e-5)
        assert 0.0 <= row["critic/score/tiny-rm/truncated_frac"] <= 1.0
    assert len({r["critic/score/tiny-rm/mean"] for r in rows}) > 1  # the model scores what was generated
    assert any(r["critic/score/tiny-rm/truncated_frac"] > 0 for r in rows)

    killed = tmp_path / "killed"
    r = kill_and_resume(killed, args, 3)
    assert "continuing from step 2" in r.stderr
    assert stable(metrics_of(killed)) == stable(rows)
    assert completed_hash(killed) == completed_hash(ref)
