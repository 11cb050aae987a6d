"""`rlctl policy replay` and `rlctl policy calibrate` on hand-made runs: the history's order across
rollbacks and resumes, the engine rewound at each turn, the calibrated numbers and their evidence, and
the commands' output and errors. (Real runs: tests/e2e/test_policy_tools.py.)"""

import json
import math

import pytest
import yaml
from click.testing import CliRunner

from rlctl import calibrate as cal
from rlctl.commands.policy import policy
from rlctl.errors import ConfigError, InputError
from rlctl.policies import PolicyEngine, validate_policy
from rlctl.rundir.record import order_history
from rlctl.rundir.replay import Turns, metric_keys, read_history, replay

KL_RULE = {
    "name": "kl",
    "when": "actor/ppo_kl > 1.0",
    "actions": [{"type": "rollback"}],
    "max_triggers": 1,
    "then": "halt",
}
DROP_RULE = {
    "name": "val-drop",
    "trigger": {"kind": "drop", "metric": "val/score/mean", "fraction": 0.2},
    "actions": [{"type": "warn"}],
}


def row(step, t, kl=0.0, **extra):
    return {"step": step, "timestamp": t, "actor/ppo_kl": kl, **extra}


def tag(event):
    return {"event": event, "time": "2026-01-01T00:00:00Z"}


# Written in this order: s1 s2 s3 (KL: rollback to 2) s3' s4' (KL again: rollback to 3) s4'' s5, a kill,
# a resume from the snapshot of step 2 (so s3', kept until then, is abandoned after s4'), s3''' s4.
KEPT = [row(1, 1.0), row(2, 2.0, **{"val/score/mean": 0.5}), row(3, 8.0), row(4, 9.0)]
ABANDONED = [
    {**row(3, 3.0, kl=5.0, **{"val/score/mean": 0.9}), "abandoned": tag("rollback")},
    {**row(4, 5.0, kl=5.0), "abandoned": tag("rollback")},
    {**row(3, 4.0, **{"val/score/mean": 0.6}), "abandoned": tag("resume")},
    {**row(4, 6.0), "abandoned": tag("resume")},
    {**row(5, 7.0), "abandoned": tag("resume")},
]


def write_run(path, kept=KEPT, abandoned=ABANDONED, policies=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(yaml.safe_dump({"policies": policies or []}))
    if kept is not None:
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    if abandoned:
        (path / "metrics.abandoned.jsonl").write_text("".join(json.dumps(r) + "\n" for r in abandoned))
    return path


def rules(*specs):
    return validate_policy({"rules": list(specs)}).rules


def test_history_is_in_write_order_across_turns(tmp_path):
    history = read_history(str(write_run(tmp_path / "run")))
    assert [(h.step, h.row["timestamp"], h.turned and h.turned["event"]) for h in history] == [
        (1, 1.0, None),
        (2, 2.0, None),
        (3, 3.0, "rollback"),
        (3, 4.0, "resume"),
        (4, 5.0, "rollback"),
        (4, 6.0, "resume"),
        (5, 7.0, "resume"),
        (3, 8.0, None),
        (4, 9.0, None),
    ]
    assert all("abandoned" not in h.row for h in history)
    assert metric_keys(history) == {"actor/ppo_kl", "val/score/mean"}


def test_ties_go_by_step_then_abandoned_first_and_a_row_without_time_follows_its_file():
    kept = [row(1, 1.0), {"step": 2, "actor/ppo_kl": 0.0}, row(3, 5.0)]
    gone = [{**row(3, 1.0), "abandoned": tag("rollback")}, {**row(2, 1.0), "abandoned": tag("rollback")}]
    order = [(h.step, h.turned is not None) for h in order_history(kept, gone)]
    # the kept step 2 takes step 1's time (1.0), as the abandoned step 2 has: the abandoned one was
    # written first (the turn that abandoned it came before the kept row was written)
    assert order == [(1, False), (2, True), (2, False), (3, True), (3, False)]


def test_same_time_and_step_puts_the_abandoned_row_first_whatever_the_file_order():
    kept = [row(1, 1.0), row(2, 2.0, kl=0.2)]
    gone = [{**row(2, 2.0, kl=0.1), "abandoned": tag("resume")}]  # the same millisecond
    assert [h.row["actor/ppo_kl"] for h in order_history(kept, gone)] == [0.0, 0.1, 0.2]


@pytest.mark.parametrize("stamp", [math.nan, math.inf, "NaN", "soon", None, True])
def test_a_timestamp_that_is_no_finite_number_counts_as_missing(stamp):
    """A NaN in a sort key silently scrambles the order: it is treated as no timestamp at all."""
    kept = [row(1, 1.0), row(2, stamp), row(3, 4.0), row(4, 5.0)]
    gone = [{**row(3, 2.0), "abandoned": tag("rollback")}, {**row(4, 3.0), "abandoned": tag("rollback")}]
    order = [(h.step, h.turned is not None) for h in order_history(kept, gone)]
    assert order == [(1, False), (2, False), (3, True), (4, True), (3, False), (4, False)]
    kept = [row(1, 1.0), row(2, 2.0), row(3, 5.0)]
    gone = [{**row(3, 3.0), "abandoned": tag("rollback")}, {**row(4, stamp), "abandoned": tag("rollback")}]
    order = [(h.step, h.turned is not None) for h in order_history(kept, gone)]
    assert order == [(1, False), (2, False), (3, True), (4, True), (3, False)]  # 4 takes 3.0, its predecessor's


def test_rows_without_any_timestamp_keep_their_file_order():
    kept = [{"step": s, "actor/ppo_kl": 0.0} for s in (1, 2, 3)]
    gone = [{"step": s, "actor/ppo_kl": 0.0, "abandoned": tag("resume")} for s in (1, 2)]
    # no time at all: by step, the abandoned row of a step before its kept row (then file order)
    order = [(h.step, h.turned is not None) for h in order_history(kept, gone)]
    assert order == [(1, True), (1, False), (2, True), (2, False), (3, False)]


def test_replay_rewinds_at_each_turn_and_keeps_the_counts(tmp_path):
    history = read_history(str(write_run(tmp_path / "run")))
    found = replay(history, rules(KL_RULE, DROP_RULE))
    # the second KL firing escalates: the count survived the rewind, as a live rollback keeps it
    assert [(r.firing.rule, r.firing.step, r.firing.count, r.firing.escalated) for r in found] == [
        ("kl", 3, 1, False),
        ("kl", 4, 2, True),
    ]
    assert [a.type for a in found[1].firing.actions] == ["halt"] and found[0].record()["turned_away"] == "rollback"
    # without the rewind, s3' (0.6) would be a drop from the abandoned s3's best (0.9)
    engine = PolicyEngine(rules(DROP_RULE))
    for step, value in ((2, 0.5), (3, 0.9)):
        engine.evaluate(step, {"val/score/mean": value})
    assert [f.step for f in engine.evaluate(3, {"val/score/mean": 0.6})] == [3]


@pytest.mark.parametrize(("turn", "counts"), [("resume", [1, 1]), ("rollback", [1, 2])])
def test_a_resume_takes_the_snapshots_counts_a_rollback_keeps_the_live_ones(turn, counts):
    """A warn-only firing after the last snapshot, then a turn back to it: a kill and a resume from the
    snapshot (its state: the firing forgotten, it fires again as the first) or a rollback (counts kept)."""
    kept = [row(1, 1.0), row(2, 2.0), row(3, 3.0), row(4, 6.0, kl=5.0), row(5, 7.0)]
    gone = [{**row(4, 4.0, kl=5.0), "abandoned": tag(turn)}, {**row(5, 5.0), "abandoned": tag(turn)}]
    watch = {"name": "watch", "when": "actor/ppo_kl > 1", "actions": [{"type": "warn"}]}
    found = replay(order_history(kept, gone), rules(watch))
    assert [(r.firing.step, r.firing.count) for r in found] == [(4, counts[0]), (4, counts[1])]


def test_a_resume_after_a_halt_keeps_the_counts_policy_state_json_carried():
    """A halt writes policy_state.json; a resume from an earlier snapshot takes its counts, rewound."""
    kl = {**KL_RULE, "then": "halt"}
    kept = [row(1, 1.0), row(2, 2.0), row(3, 8.0, kl=5.0)]
    gone = [
        {**row(3, 3.0, kl=5.0), "abandoned": tag("rollback")},  # fires: rollback to 2
        {**row(3, 4.0), "abandoned": tag("resume")},
        {**row(4, 5.0, kl=5.0), "abandoned": tag("resume")},  # fires again: max_triggers 1, halt
    ]
    found = replay(order_history(kept, gone), rules(kl))
    assert [(r.firing.step, r.firing.count, r.firing.escalated) for r in found] == [
        (3, 1, False),
        (4, 2, True),
        (3, 3, True),  # after `resume --from step-2`: the halt's counts, not step 2's snapshot's
    ]


@pytest.mark.parametrize("validates_first", [False, True])
def test_a_resume_that_found_no_snapshot_starts_over_fresh(validates_first):
    """A warn rule (no rollback, so no snapshot of step 0) halts at step 3 (policy_state.json written);
    the resume finds no snapshot and starts over (rlctl.engine.recovery.Recovery.resume: nothing restored, nothing
    carried): the rule fires again as the first time, not escalated. With a step-0 validation row, the
    fresh run writes step 0 again (a turn to step -1); without, the turn is to step 0."""
    watch = {"name": "watch", "when": "actor/ppo_kl > 1", "actions": [{"type": "warn"}], "max_triggers": 1}
    first = [row(1, 1.0), row(2, 2.0, kl=5.0), row(3, 3.0, kl=5.0)]  # fires, then halts (escalated)
    kept = [row(1, 5.0), row(2, 6.0, kl=5.0)]
    if validates_first:
        first, kept = [row(0, 0.5), *first], [row(0, 4.5), *kept]
    gone = [{**r, "abandoned": tag("resume")} for r in first]
    found = replay(order_history(kept, gone), rules(watch))
    assert [(r.firing.step, r.firing.count, r.firing.escalated) for r in found] == [
        (2, 1, False),
        (3, 2, True),
        (2, 1, False),  # fresh: not the halt's counts (3, 2 past max_triggers) that policy_state.json holds
    ]


def test_a_resume_to_step_0_of_a_rolling_back_policy_had_its_snapshot_and_carries_the_counts():
    """A policy that rolls back snapshots step 0 before training, so a resume to step 0 restored it
    and carried policy_state.json (as of a later halt); a fresh start is only for a run without one."""
    engine = PolicyEngine(rules(KL_RULE))
    for turns, carried in ((Turns(engine, snapshot_at_start=True), True), (Turns(engine), False)):
        engine.load_state_dict(turns.fresh)
        engine.evaluate(1, row(1, 1.0, kl=5.0))
        turns.evaluated(1, halted=True)
        turns.turn(0, resumed=True)
        assert (engine.state_dict() != turns.fresh) is carried
        assert turns.persisted is not None and turns.persisted[0] == (0 if carried else 1)


def test_replay_command_table_json_and_default_policies(tmp_path):
    run = write_run(tmp_path / "run", policies=[{"rules": [KL_RULE, DROP_RULE]}])
    table = CliRunner().invoke(policy, ["replay", str(run)])
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].split() == [
        "step",
        "rule",
        "trigger",
        "metric",
        "value",
        "limit",
        "actions",
        "count",
        "turned_away",
    ]
    assert lines[1].split()[:2] == ["3", "kl"] and lines[2].split()[-3:] == ["(escalated)", "2", "rollback"]
    assert lines[-2:] == ["kl: fired 2 times, at steps 3, 4", "never fired: val-drop"]
    assert "replayed 9 rows" in table.stderr and "(5 abandoned) through 2 rules: 2 firings" in table.stderr
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump({"rules": [{**KL_RULE, "when": "actor/ppo_kl > 9"}]}))
    as_json = CliRunner().invoke(policy, ["replay", str(run), "--policy", str(other), "--format", "json"])
    assert json.loads(as_json.stdout) == []


def test_replay_errors(tmp_path):
    empty = write_run(tmp_path / "empty", kept=None, abandoned=None, policies=[{"rules": [KL_RULE]}])
    result = CliRunner().invoke(policy, ["replay", str(empty)])
    assert type(result.exception) is InputError and "has no metric rows" in result.exception.message
    assert result.exception.exit_code == 4
    bare = write_run(tmp_path / "bare")
    result = CliRunner().invoke(policy, ["replay", str(bare)])
    assert type(result.exception) is ConfigError and "--policy FILE" in result.exception.message
    result = CliRunner().invoke(policy, ["replay", str(tmp_path / "nothing"), "--policy", "default"])
    assert type(result.exception) is ConfigError and "not an rlctl run directory" in result.exception.message


# -- calibrate ------------------------------------------------------------------------------------------
def healthy_rows(n=200):
    """A run with KL around 0.01 (one outlier 0.05), grad norms around 1 (one 2.4), entropy falling."""
    rows = []
    for s in range(1, n + 1):
        kl = 0.05 if s == 30 else 0.01 + 0.0001 * (s % 7)
        grad = 2.4 if s == 20 else 1.0 + 0.05 * (s % 5)
        rows.append({"step": s, "actor/ppo_kl": kl, "actor/grad_norm": grad, "actor/entropy": 3.0 - s * 0.01})
    return rows


def test_quantile_and_rounding():
    assert cal.quantile([1, 2, 3, 4], 0.5) == 2.5 and cal.quantile([5], 0.99) == 5
    assert cal.quantile(list(range(101)), 0.99) == pytest.approx(99)
    assert cal.rounded(0.0123456, up=True) == 0.0124 and cal.rounded(0.0123456, up=False) == 0.0123
    assert cal.rounded(-0.0123456, up=True) == -0.0123
    assert cal.number_text(1e-7) == "1.0e-07" and cal.number_text(0.00185) == "0.00185"
    assert cal.beyond(0.05, up=True) == 0.0501 and cal.beyond(3.0, up=False) == 2.99


def test_limits_take_the_larger_of_quantile_and_margin_or_just_past_the_extreme():
    values = [0.01] * 99 + [0.05]
    limit, qv = cal.upper_limit(values, 0.99, 0.5)
    assert qv == pytest.approx(0.0104) and limit == 0.0501  # the outlier is above q x 1.5: just above it
    limit, qv = cal.upper_limit([0.01, 0.02, 0.03], 0.99, 0.5)
    assert limit == cal.rounded(qv * 1.5, up=True) > 0.03
    assert cal.upper_limit([-0.02, -0.01], 0.99, 0.5)[0] == -0.00505  # a negative KL: q + 0.5 |q| is above
    floor, low = cal.floor_limit([3.0, 2.0, 1.0], 0.99, 0.5)
    assert low == pytest.approx(1.02) and floor == 0.51
    ratios = cal.spike_ratios([(1, 1.0), (2, 1.0), (3, 3.0), (4, 0.0)], window=128, min_history=2)
    assert ratios == [(3, 3.0), (4, 0.0)]
    assert cal.spike_ratios([(1, 0.0), (2, 0.0), (3, 1.0)], 128, 2) == [(3, math.inf)]


def test_calibrate_proposes_rules_that_never_fire_here_with_their_evidence():
    rows = healthy_rows()
    found = cal.calibrate(rows, 0.99, 0.5, "RUN")
    by_name = {p.signal.name: p for p in found.proposals}
    assert list(by_name) == ["kl", "grad-spike", "entropy-floor"]
    assert all(p.fired == 0 for p in found.proposals)
    assert by_name["kl"].rule["when"] == "actor/ppo_kl > 0.0501"  # the step-30 outlier sets it
    assert any("0.99 quantile" in line and "max 0.05 (step 30)" in line for line in by_name["kl"].evidence)
    spike = by_name["grad-spike"].rule["trigger"]
    assert spike["min_history"] == 16 and spike["factor"] == cal.rounded(2.4 / 1.1 * 1.5, up=True)
    assert by_name["entropy-floor"].rule["when"].startswith("actor/entropy < ")
    assert [s.name for s, _ in found.left_out] == ["repetition", "ppo-ratio"]
    # a limit one notch tighter than the max seen would fire: the margin is what keeps it quiet
    tight = {**by_name["kl"].rule, "when": "actor/ppo_kl > 0.0499"}
    assert cal.count_firings(tight, rows) == 1


def test_the_policy_text_round_trips_into_the_rules_that_were_replayed():
    rows = [{**r, "response/repetition/mean": 0.2 + 0.001 * r["step"]} for r in healthy_rows()]
    rows = [{**r, "actor/ppo_ratio/max": 1.1} for r in rows]  # constant: no spread
    found = cal.calibrate(rows, 0.95, 1.0, "s3://bucket/run")
    text = cal.render(found)
    loaded = validate_policy(yaml.safe_load(text))
    assert loaded.rules == [cal.as_rule(p.rule) for p in found.proposals]
    assert [r.name for r in loaded.rules] == ["kl", "grad-spike", "entropy-floor", "repetition"]
    assert "# left out ppo-ratio: actor/ppo_ratio/max was 1.1 at every step" in text
    assert text.count("  # replayed on this run: fires 0 times") == 4
    kl = loaded.rules[0]
    assert [a.type for a in kl.actions] == ["rollback", "adjust"] and kl.max_triggers == 3 and kl.then == "halt"
    assert [a.type for a in loaded.rules[2].actions] == ["warn"]


@pytest.mark.parametrize(
    ("rows", "why"),
    [
        (healthy_rows(1), "from its 1 row (steps 1-1): kl: actor/ppo_kl has 1 finite value in this run"),
        (
            [{**r, "actor/ppo_kl": 0.01, "actor/grad_norm": 1.0, "actor/entropy": 2.0} for r in healthy_rows(30)],
            "kl: actor/ppo_kl was 0.01 at every step",
        ),
        ([{"step": s, "actor/entropy": math.inf} for s in (1, 2, 3)], "entropy-floor: this run never wrote"),
    ],
)
def test_a_run_that_gives_no_rule_is_an_input_error_not_an_empty_policy(rows, why):
    with pytest.raises(InputError) as err:
        cal.calibrate(rows, 0.99, 0.5, "RUN")
    assert err.value.exit_code == 4
    assert err.value.message.startswith("run RUN gives nothing to calibrate") and why in err.value.message
    assert "grad-spike:" in err.value.message and "ppo-ratio: this run never wrote" in err.value.message


def test_non_finite_values_are_left_to_the_nonfinite_rule_in_the_limits_and_in_the_replay():
    rows = healthy_rows()
    rows[49]["actor/ppo_kl"], rows[99]["actor/ppo_kl"] = math.inf, -math.inf  # an inf once counted as a firing
    rows[59]["actor/grad_norm"] = math.nan
    found = {p.signal.name: p for p in cal.calibrate(rows, 0.99, 0.5, "RUN").proposals}
    assert found["kl"].rule["when"] == "actor/ppo_kl > 0.0501" and found["kl"].fired == 0
    assert found["kl"].evidence[-1] == (
        "replayed on this run: fires 0 times (leaving out 2 steps where actor/ppo_kl was not finite)"
    )
    assert found["grad-spike"].fired == 0 and "leaving out 1 step where" in found["grad-spike"].evidence[-1]
    assert found["entropy-floor"].evidence[-1] == "replayed on this run: fires 0 times"
    assert cal.count_firings(found["kl"].rule, rows) == 1  # +inf itself is above any limit


def share_rows(top):
    """A run with one share rising to ``top`` at the last step (and the KL of healthy_rows)."""
    return [{**r, "response/repetition/mean": top * r["step"] / 200} for r in healthy_rows()]


def test_a_share_limit_is_capped_at_1_and_fires_only_on_1():
    found = cal.calibrate(share_rows(0.9), 0.99, 0.5, "RUN")
    (rep,) = [p for p in found.proposals if p.signal.name == "repetition"]
    assert rep.rule["when"] == "response/repetition/mean >= 1" and rep.fired == 0  # 0.9 x 1.5 would be 1.34
    assert any(line.startswith("capped at 1: a share is never above it") for line in rep.evidence)
    assert cal.count_firings(rep.rule, [{"step": 1, "response/repetition/mean": 1.0}]) == 1  # it can fire
    validate_policy(yaml.safe_load(cal.render(found)))
    low = cal.calibrate(share_rows(0.4), 0.99, 0.5, "RUN")  # its 0.99 quantile 0.396 x 1.5: no cap
    assert [p.rule["when"] for p in low.proposals if p.signal.name == "repetition"] == [
        "response/repetition/mean > 0.595"
    ]


def test_a_share_that_reached_1_is_left_out():
    found = cal.calibrate(share_rows(1.0), 0.99, 0.5, "RUN")
    assert "repetition" not in [p.signal.name for p in found.proposals]
    assert (
        "repetition",
        "response/repetition/mean reached 1, the most a share can be, at step 200: no limit above it can fire",
    ) in [(s.name, why) for s, why in found.left_out]


def test_calibrate_command_until_and_errors(tmp_path):
    run = write_run(tmp_path / "run", kept=healthy_rows(), abandoned=None)
    result = CliRunner().invoke(policy, ["calibrate", str(run), "--until", "25"])
    assert result.exit_code == 0, result.output
    assert "steps 1-25 (25 rows)" in result.stdout and "left out repetition" in result.stderr
    assert "actor/ppo_kl > 0.0501" not in result.stdout  # the outlier at step 30 is past --until
    validate_policy(yaml.safe_load(result.stdout))
    early = CliRunner().invoke(policy, ["calibrate", str(run), "--until", "0"])
    assert type(early.exception) is InputError and "up to step 0" in early.exception.message
    one = CliRunner().invoke(policy, ["calibrate", str(run), "--until", "1"])  # one row: no rule, no policy
    assert type(one.exception) is InputError and "gives nothing to calibrate from its 1 row" in one.exception.message
    assert one.stdout == ""
    bad = CliRunner().invoke(policy, ["calibrate", str(run), "--quantile", "1.5"])
    assert bad.exit_code == 2


def test_commands_read_a_run_on_any_fsspec_storage():
    from rlctl.storage import Storage

    url = "memory://tools-test/run"
    run = Storage(url)
    run.write_bytes("config.yaml", yaml.safe_dump({"policies": [{"rules": [KL_RULE]}]}).encode())
    run.write_bytes("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in KEPT).encode())
    run.write_bytes("metrics.abandoned.jsonl", "".join(json.dumps(r) + "\n" for r in ABANDONED).encode())
    replayed = CliRunner().invoke(policy, ["replay", url, "--format", "json"])
    assert [f["step"] for f in json.loads(replayed.stdout)] == [3, 4]
    calibrated = CliRunner().invoke(policy, ["calibrate", url])  # KEPT's KL is 0 at every step: nothing to do
    assert type(calibrated.exception) is InputError and "kl: actor/ppo_kl was 0 at every step" in str(
        calibrated.exception
    )
    run.write_bytes("metrics.jsonl", "".join(json.dumps(r) + "\n" for r in healthy_rows(40)).encode())
    calibrated = CliRunner().invoke(policy, ["calibrate", url])
    assert calibrated.exit_code == 0 and "left out repetition: this run never wrote" in calibrated.stdout
