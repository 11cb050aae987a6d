"""algorithm.rollout_correction end to end on the built-in task (`rlctl start` in this process, real
DeepSpeed): each mode's rows carry finite rollout_corr metrics, on-policy (the old log-probs from the
update's own forward) and off-policy (a separate pass, ppo_epochs 2); a step without rollout log-probs
(the degenerate drill) has no correction and no such metric. The HF sampler and the actor are the same
fp32 model, so the ratio is 1 to within rounding and nothing is capped: what a healthy engine shows."""

import math

import pytest

from helpers import REPO, drills, invoke, metrics_of, start_args

CORR = ("rollout_corr/ratio_mean", "rollout_corr/ratio_max", "rollout_corr/clipfrac")


@pytest.mark.parametrize(
    ("mode", "more"),
    [("tis", []), ("masked", ["algorithm.ppo_epochs=2"])],
    ids=["tis-on-policy", "masked-off-policy"],
)
def test_the_correction_reports_its_metrics(tmp_path, mode, more):
    sets = [f"algorithm.rollout_correction.mode={mode}", "trainer.prompts_per_step=4", "algorithm.group_size=4"]
    args = [a for s in [*sets, *more] for a in ("--set", s)]
    r = invoke("start", *start_args(tmp_path / mode, steps=3), *args, *drills("degenerate@2"), cwd=REPO)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(tmp_path / mode)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (row["step"], bad)
    for row in (rows[0], rows[2]):
        assert row["rollout_corr/ratio_mean"] == pytest.approx(1.0, abs=1e-4)
        assert row["rollout_corr/ratio_max"] == pytest.approx(1.0, abs=1e-3)
        assert row["rollout_corr/clipfrac"] == 0.0
        assert row["rollout/logprob_diff"] < 1e-4
    assert not set(CORR) & set(rows[1])  # the degenerate step: no rollout log-probs, no correction
