"""Each algorithm of the family, end to end on the built-in task: finite metrics, and the reward of the
last 10 steps clearly above that of the first 10 (the installed `rlctl`, real DeepSpeed)."""

import math

import pytest

from conftest import metrics_of, run_cli

pytestmark = pytest.mark.slow

VARIANTS = {
    "grpo": [],
    "drgrpo": ["algorithm.adv_estimator=drgrpo", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.kl_coef=0.01",
                            "algorithm.kl_in_reward=true"],
    "reinforce_plus_plus_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "gspo": ["algorithm.importance_ratio=sequence", "algorithm.clip_ratio_low=0.0003", "algorithm.clip_ratio_high=0.0004",
             "algorithm.loss_agg_mode=seq-mean-token-mean", "actor.mini_batch_size=64"],
    "dapo": ["algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.28", "algorithm.dynamic_sampling.enabled=true",
             "algorithm.overlong.enabled=true", "algorithm.loss_agg_mode=token-mean", "algorithm.entropy_coef=0.001"],
    "ppo": ["algorithm.name=ppo", "algorithm.group_size=4", "trainer.prompts_per_step=32", "critic.lr=1e-3",
            "algorithm.lam=0.95", "actor.mini_batch_size=64", "actor.micro_batch_size=32", "critic.warmup_steps=2"],
    "adaptive_kl": ["algorithm.kl_coef=0.05", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.01",
                    "algorithm.kl_ctrl.horizon=1000"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANTS))
def test_variant_learns(tmp_path, name):
    steps = 80
    sets = [f"trainer.total_steps={steps}", *VARIANTS[name]]
    r = run_cli("start", "--run-dir", str(tmp_path / name), *[a for s in sets for a in ("--set", s)])
    assert r.returncode == 0, r.stderr
    rows = metrics_of(tmp_path / name)
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
    first = sum(r["critic/score/mean"] for r in rows[:10]) / 10
    last = sum(r["critic/score/mean"] for r in rows[-10:]) / 10
    assert last > 1.5 * first and last - first > 0.03, (name, first, last)
    if name == "adaptive_kl":
        coefs = [row["actor/kl_coef"] for row in rows]
        assert coefs[0] == 0.05 and coefs[-1] != coefs[0]  # the controller moved it
    if name == "ppo":
        assert "actor/pg_loss" not in rows[0] and "actor/pg_loss" in rows[2]  # critic warm-up: no actor step
        assert all(row["critic/vf_loss"] >= 0 for row in rows) and "critic/values/mean" in rows[-1]
    if name == "dapo":
        assert all(row["dynamic_sampling/rounds"] >= 1 for row in rows)
