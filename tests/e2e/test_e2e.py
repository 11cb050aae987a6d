"""Real runs of the `rlctl` entry point in a subprocess, on the tiny built-in model."""

import math
import textwrap

import orjson
import yaml

from rlctl.errors import ExitCode

from helpers import REPO, SMALL, invoke, metrics_of, run_cli, start_args

REQUIRED = [
    "step",
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/entropy",
    "actor/grad_norm",
    "actor/lr",
    "critic/score/mean",
    "critic/advantages/mean",
    "response_length/mean",
    "timing_s/gen",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "actor/nonfinite/old_log_prob",
    "actor/nonfinite/ref_log_prob",
    "actor/nonfinite/log_prob",
    "actor/nonfinite/loss",
]


def test_demo_learns(tmp_path):
    """A shorter demo through the real entry point: one metrics row per step, every metric finite, and the
    reward of the last 10 steps clearly above that of the first 10 (GRPO, the default algorithm: this is
    also test_algorithms_e2e.py's GRPO variant, which would be the same command)."""
    run_dir = tmp_path / "demo"
    steps = 80
    r = run_cli("start", *start_args(run_dir, steps=steps))
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{run_dir}\n"  # stdout is data only
    assert "reward" in r.stderr and "done" in r.stderr
    rows = metrics_of(run_dir)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        assert set(REQUIRED) <= set(row)
        assert row["actor/nonfinite/loss"] == 0 and math.isfinite(row["actor/grad_norm"])
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
    first = sum(r["critic/score/mean"] for r in rows[:10]) / 10
    last = sum(r["critic/score/mean"] for r in rows[-10:]) / 10
    assert last > 1.5 * first and last - first > 0.03, (first, last)
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["trainer"]["total_steps"] == steps and resolved["actor"]["lr"] == 2e-3
    assert (run_dir / "model" / "tokenizer.json").exists() and (run_dir / "model" / "config.json").exists()


def test_kl_zero3_off_policy_minibatches(tmp_path):
    """Reference model + k3 KL under ZeRO-3, two PPO epochs over two mini-batches (old log-probs from a
    separate pass): every metric finite, the policy drifts from the reference and the ratio from 1."""
    run_dir = tmp_path / "kl"
    sets = ["algorithm.kl_coef=0.1", "algorithm.kl_estimator=k3", "actor.zero_stage=3", "algorithm.ppo_epochs=2"]
    r = invoke(
        "start",
        *start_args(run_dir, steps=6),
        *SMALL,
        *[a for s in [*sets, "actor.mini_batch_size=8"] for a in ("--set", s)],
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run_dir)
    assert len(rows) == 6
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
        assert row["actor/kl_coef"] == 0.1
    assert rows[0]["actor/kl_loss"] >= 0 and rows[-1]["actor/kl_loss"] > 0
    assert any(row["actor/ppo_kl"] != 0 for row in rows)  # later mini-batches are off-policy


def test_user_model_data_and_reward(tmp_path, tiny_model_dir):
    """model.path (the built-in model as a run writes it into RUN_DIR/model), data.path (JSONL with extra
    columns) and a module:function reward, as for a real model."""
    data = tmp_path / "math.jsonl"
    data.write_bytes(
        b"".join(orjson.dumps({"question": f"{i}+{i}=", "answer": f"#### {2 * i}"}) + b"\n" for i in range(10))
    )
    cfg = tmp_path / "real.yaml"
    cfg.write_text(
        textwrap.dedent(f"""
        name: math
        model: {{path: {tiny_model_dir}}}
        data: {{path: {data}, prompt_key: question}}
        reward: {{function: "rlctl.engine.reward.gsm8k:exact_match", kwargs: {{format_score: 0.1}}}}
        trainer: {{total_steps: 3, prompts_per_step: 2}}
        algorithm: {{group_size: 4}}
        rollout: {{max_new_tokens: 4}}
    """)
    )
    run_dir = tmp_path / "math"
    r = invoke("start", *start_args(run_dir, config=cfg), cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run_dir)
    assert len(rows) == 3 and all(0 <= row["critic/score/mean"] <= 1 for row in rows)
    assert not (run_dir / "model").exists()  # a user model is used in place, not copied


def test_reward_errors_are_sentences(tmp_path):
    """A reward function that returns the wrong number of scores: exit 4 and a sentence. (A reward module
    that does not exist is exit 3 before any work: test_lifecycle.py; one that fails to import is exit 4:
    test_user_code.py.)"""
    mod = tmp_path / "badreward.py"
    mod.write_text("def f(prompts, completions, **kw):\n    return [1.0]\n")
    r = run_cli("start", *start_args(tmp_path / "x", steps=1), "--set", "reward.function=badreward:f", cwd=tmp_path)
    assert r.returncode == ExitCode.INPUT, r.stderr
    assert "reward function 'badreward:f' returned 1 scores for 128 completions" in r.stderr
    assert "Traceback" not in r.stderr
