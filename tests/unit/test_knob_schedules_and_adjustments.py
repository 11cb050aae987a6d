"""The knobs: one list (rlctl.policies.knobs), each a number field of the run config with a legal domain;
schedules (maths worked out by hand), their composition with policy adjustments, located config errors,
`resume --set` of nested keys, and DeepSpeed following a new gradient clip and weight decay."""

import math
import textwrap

import pytest
import torch
import yaml

from rlctl.config import RunConfig, check_policies_fit, load_config, validate_config
from rlctl.config.knob_values import (
    ScheduleConfig,
    adjust_knob,
    apply_knob_settings,
    domain,
    follow_schedules,
    get_knob,
    in_domain,
    is_float_field,
    knob_settings,
    may_exceed,
    set_knob,
)
from rlctl.errors import ConfigError
from rlctl.policies import load_policies
from rlctl.policies.knobs import KNOBS, SAFE_ON_RESUME
from rlctl.rundir.overrides import apply_resume_overrides


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def sched(*entries, **kw):
    return ScheduleConfig(
        schedule=[dict(zip(("until", "value"), e)) if len(e) == 2 else {"value": e[0]} for e in entries], **kw
    )


# -- the list -------------------------------------------------------------------------------------------
def test_every_knob_is_a_number_field_of_the_run_config_with_a_domain():
    assert set(KNOBS) <= SAFE_ON_RESUME
    for key in KNOBS:
        assert is_float_field(RunConfig, key), key
        assert not domain(RunConfig, key).contains(-1.0), key  # every knob is a non-negative amount
    assert not is_float_field(RunConfig, "actor.zero_stage") and not is_float_field(RunConfig, "actor.nope")
    for model in (ScheduleConfig, ScheduleConfig.model_fields["schedule"].annotation.__args__[0]):
        assert all(f.description for f in model.model_fields.values()), model


def test_get_and_set_by_dotted_key_nested_included():
    cfg = RunConfig()
    assert get_knob(cfg, "algorithm.kl_ctrl.target_kl") == 0.1
    set_knob(cfg, "algorithm.kl_ctrl.target_kl", 0.05)
    assert cfg.algorithm.kl_ctrl.target_kl == 0.05
    assert get_knob(cfg, "algorithm.clip_ratio_high") is None
    with pytest.raises(ValueError):  # the field's own validation still applies
        set_knob(cfg, "algorithm.clip_ratio", 1.5)


def test_domains_come_from_the_schema_and_hold_values_at_the_nearest_legal_one():
    clip = domain(RunConfig, "algorithm.clip_ratio")  # gt=0, lt=1
    assert (clip.lo, clip.lo_open, clip.hi, clip.hi_open) == (0.0, True, 1.0, True)
    assert clip.describe() == "> 0 and < 1"
    assert domain(RunConfig, "algorithm.clip_ratio_c").describe() == "> 1"
    assert domain(RunConfig, "algorithm.kl_coef").describe() == ">= 0"
    cfg = RunConfig()
    assert in_domain(cfg, "algorithm.clip_ratio", 1.2) == (
        math.nextafter(1.0, 0.0),
        "1.2 is outside algorithm.clip_ratio's legal values (> 0 and < 1): held at 0.9999999999999999",
    )
    assert in_domain(cfg, "algorithm.kl_coef", -0.5)[0] == 0.0
    assert in_domain(cfg, "actor.lr", 0.0)[0] == 5e-324
    assert in_domain(cfg, "actor.lr", 1e-5) == (1e-5, None)


# -- schedule maths, by hand ----------------------------------------------------------------------------
def test_step_mode_by_fraction_holds_each_value_up_to_its_until_inclusive():
    s = sched((0.3, 1.0), (0.7, 2.0), (3.0,))
    # progress s/10: steps 1-3 <= 0.3 (3/10 is just above 0.3 in floats: still in), 4-7 <= 0.7, then the last
    assert [s.value_at(i, 10) for i in range(11)] == [1.0] * 4 + [2.0] * 4 + [3.0] * 3


def test_step_mode_by_step_and_the_last_value_holds_after_every_until():
    s = sched((2, 0.0), (5, 0.5), unit="step")
    assert [s.value_at(i, 8) for i in range(9)] == [0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5, 0.5, 0.5]


def test_linear_mode_ramps_between_entries():
    s = sched((0.2, 0.0), (0.6, 1.0), (1.0, 0.0), mode="linear")
    got = [s.value_at(i, 10) for i in range(11)]
    want = [0.0, 0.0, 0.0, 0.25, 0.5, 0.75, 1.0, 0.75, 0.5, 0.25, 0.0]
    assert got == pytest.approx(want, abs=1e-12)
    by_step = sched((2, 0.0), (4, 1.0), mode="linear", unit="step")  # then 1.0 holds
    assert [by_step.value_at(i, 10) for i in range(7)] == [0.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0]
    to_end = sched((0.5, 1.0), (0.0,), mode="linear")  # a last entry without until ends at the end
    assert [to_end.value_at(i, 4) for i in range(5)] == [1.0, 1.0, 1.0, 0.5, 0.0]


def test_adjustments_compose_with_a_schedule():
    s = sched((0.5, 0.0), (0.002,))
    m = s.adjusted("multiply", 0.5)
    assert (m.scale, m.offset) == (0.5, 0.0) and m.value_at(10, 10) == 0.001
    a = m.adjusted("add", 0.01, hi=0.0105)
    assert (a.offset, a.max) == (0.01, 0.0105)
    assert [a.value_at(i, 10) for i in (1, 10)] == [0.01, 0.0105]  # clamp(0 * .5 + .01), clamp(.002 * .5 + .01)
    m2 = a.adjusted("multiply", 2.0, lo=0.001, hi=0.05)  # bounds only tighten: max stays 0.0105
    assert (m2.scale, m2.offset, m2.min, m2.max) == (1.0, 0.02, 0.001, 0.0105)
    pinned = m2.adjusted("set", 0.003)
    assert [pinned.value_at(i, 10) for i in (1, 10)] == [0.003, 0.003]
    assert pinned.schedule == s.schedule  # the schedule itself is never rewritten


def test_bounds_that_cross_after_two_rules_keep_the_max_and_the_config_still_loads():
    """Rule A adds 0.01 with max 0.015, rule B doubles with min 0.02: the max wins (as in the clamp), so
    min is lowered to it and RUN_DIR/config.yaml (what a resume reads) still validates."""
    cfg = validate_config(
        {
            "trainer": {"total_steps": 10},
            "algorithm": {"kl_coef": {"schedule": [{"until": 0.5, "value": 0.0}, {"value": 0.002}]}},
        }
    )
    adjust_knob(cfg, "algorithm.kl_coef", 0.0, "add", 0.01, None, 0.015, step=2)
    new, _ = adjust_knob(cfg, "algorithm.kl_coef", 0.01, "multiply", 2.0, 0.02, None, step=2)
    s = cfg.schedules["algorithm.kl_coef"]
    assert (s.scale, s.offset, s.min, s.max) == (2.0, 0.02, 0.015, 0.015) and new == 0.015
    again = validate_config(yaml.safe_load(cfg.to_yaml()))
    assert again.schedules == cfg.schedules and again.algorithm.kl_coef == 0.015
    assert s.adjusted("add", 1.0, hi=0.01).min == 0.01  # a new max below the min lowers the min too


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("where", ["value", "scale", "offset", "min", "max", "until"])
def test_a_schedule_takes_finite_numbers_only(where, bad):
    entry = {"until": bad if where == "until" else 0.5, "value": bad if where == "value" else 0.1}
    fields = {where: bad} if where not in ("value", "until") else {}
    with pytest.raises(ValueError, match="finite number"):
        ScheduleConfig(schedule=[entry, {"value": 0.2}], **fields)


# -- the knobs as plain data (the policy state carries them) --------------------------------------------
def test_knob_settings_round_trip_and_a_resume_set_keeps_its_knobs():
    cfg = validate_config(
        {
            "trainer": {"total_steps": 10},
            "actor": {"lr": {"schedule": [{"until": 0.5, "value": 1e-3}, {"value": 2e-3}]}},
        }
    )
    adjust_knob(cfg, "actor.lr", 1e-3, "multiply", 0.5, 1e-4, None, step=3)
    adjust_knob(cfg, "algorithm.kl_coef", 0.0, "add", 0.01)
    saved = knob_settings(cfg)
    assert set(saved) == set(KNOBS)
    assert saved["algorithm.kl_coef"] == {"value": 0.01}
    assert saved["actor.lr"] == {"value": 5e-4, "scale": 0.5, "offset": 0.0, "min": 1e-4, "max": None}
    assert saved["algorithm.clip_ratio_high"] == {"value": None}
    later = cfg.model_copy(deep=True)  # more adjustments after the settings were taken
    adjust_knob(later, "algorithm.kl_coef", 0.01, "add", 0.01)
    adjust_knob(later, "actor.lr", 5e-4, "set", 3e-3, step=3)
    adjust_knob(later, "algorithm.clip_ratio_high", None, "set", 0.28)
    set_knob(later, "actor.grad_clip", 0.3)  # as if resume --set actor.grad_clip=0.3
    apply_knob_settings(later, saved, keep={"actor.grad_clip"})
    assert knob_settings(later) == {**saved, "actor.grad_clip": {"value": 0.3}}
    assert [later.schedules["actor.lr"].value_at(s, 10) for s in (1, 10)] == [5e-4, 1e-3]


@pytest.mark.parametrize(
    "settings",
    [
        {"actor.lr": {"value": 0.0}},  # outside the domain
        {"actor.lr": {"value": None}},  # not an optional knob
        {"actor.nope": {"value": 1.0}},
        {"algorithm.kl_coef": 5},
        {"algorithm.kl_coef": {"value": "x"}},
        {"actor.lr": {"value": 1e-3, "scale": 1.0, "offset": 0.0, "min": 2.0, "max": 1.0}},
    ],
)
def test_knob_settings_that_do_not_fit_change_nothing(settings):
    cfg = validate_config({"actor": {"lr": {"schedule": [{"value": 1e-3}]}}})
    before = knob_settings(cfg)
    with pytest.raises((ValueError, TypeError)):
        apply_knob_settings(cfg, {"algorithm.kl_coef": {"value": 0.5}, **settings})
    assert knob_settings(cfg) == before


# -- the config -----------------------------------------------------------------------------------------
def test_a_schedule_at_the_knobs_place_moves_to_schedules_and_the_field_holds_its_value_at_step_0(tmp_path):
    p = write(
        tmp_path,
        """\
        trainer: {total_steps: 10}
        algorithm:
          kl_coef:
            schedule: [{until: 0.2, value: 0.0}, {value: 0.001}]
        schedules:
          actor.lr: {schedule: [{until: 0, value: 1.0e-6}, {value: 1.0e-5}], mode: linear}
        """,
    )
    cfg = load_config(p, ["algorithm.entropy_coef={schedule: [{value: 0.2}]}"])
    assert set(cfg.schedules) == {"algorithm.kl_coef", "actor.lr", "algorithm.entropy_coef"}
    assert (cfg.algorithm.kl_coef, cfg.actor.lr, cfg.algorithm.entropy_coef) == (0.0, 1e-6, 0.2)
    follow_schedules(cfg, 5)
    assert (cfg.algorithm.kl_coef, cfg.actor.lr) == (0.001, pytest.approx(5.5e-6))  # half way from 1e-6 to 1e-5
    again = validate_config(yaml.safe_load(cfg.to_yaml()))  # what RUN_DIR/config.yaml holds
    assert again.schedules == cfg.schedules and again.actor.lr == cfg.actor.lr  # the field is not reset


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "algorithm:\n  kl_coef:\n    schedule:\n      - {until: 0.4, value: 0.0}\n      - {until: 0.3, value: 1}\n",
            "'schedules.algorithm.kl_coef' (run.yaml line 2): the entries' 'until' must increase, got [0.4, 0.3]",
        ),
        (
            "algorithm:\n  kl_coef:\n    schedule: [{value: 0.1}, {value: 0.0}]\n",
            "(run.yaml line 2): entry 0 has no 'until': only the last entry may omit it",
        ),
        (
            "algorithm:\n  kl_coef:\n    schedule: [{until: 2, value: 0.1}, {value: 0.0}]\n",
            "with unit: fraction, 'until' is a fraction of trainer.total_steps (<= 1), got 2.0",
        ),
        (
            "algorithm:\n  clip_ratio:\n    schedule: [{until: 0.5, value: 0.2}, {value: 1.5}]\n",
            "'schedules' (run.yaml line 2): algorithm.clip_ratio: the value of entry 1 (1.5) is not a legal "
            "algorithm.clip_ratio (> 0 and < 1)",
        ),
        (
            "actor:\n  lr:\n    schedule: [{value: 1.0e-6}]\n    mode: cosine\n",
            "'schedules.actor.lr.mode' (run.yaml line 4): input should be 'step' or 'linear'",
        ),
        (
            "algorithm:\n  kl_coef:\n    schedul: [{value: 0.1}]\n",
            "unknown key 'schedules.algorithm.kl_coef.schedul' (run.yaml line 3); did you mean "
            "'schedules.algorithm.kl_coef.schedule'?",
        ),
        (
            "schedules:\n  actor.lrr: {schedule: [{value: 0.1}]}\n",
            "did you mean 'actor.lr'?",
        ),
        (
            "algorithm:\n  kl_ctrl: {type: adaptive}\n  kl_coef: {schedule: [{value: 0.1}]}\n",
            "algorithm.kl_coef has a schedule, but algorithm.kl_ctrl.type is adaptive",
        ),
        ("algorithm:\n  kl_in_reward: true\n", "algorithm.kl_in_reward needs algorithm.kl_coef > 0"),
    ],
)
def test_schedule_mistakes_are_located_sentences(tmp_path, text, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    assert message in err.value.message


def test_kl_in_reward_accepts_a_warm_up_from_zero_and_the_reference_is_known_to_be_needed(tmp_path):
    cfg = load_config(
        write(
            tmp_path,
            "algorithm:\n  kl_in_reward: true\n  kl_coef: {schedule: [{until: 0.5, value: 0}, {value: 0.01}]}\n",
        )
    )
    assert cfg.algorithm.kl_coef == 0.0 and may_exceed(cfg, "algorithm.kl_coef", 0.0)
    assert not may_exceed(RunConfig(), "algorithm.kl_coef", 0.0)


def policy_cfg(tmp_path, action, when="actor/ppo_kl > 0.1", extra=""):
    text = f'policies:\n  - rules:\n      - name: r\n        when: "{when}"\n        actions: [{action}]\n{extra}'
    return write(tmp_path, text)


def test_a_policy_that_multiplies_or_adds_to_an_empty_knob_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(policy_cfg(tmp_path, "{type: adjust, multiply: {algorithm.clip_ratio_high: 1.1}}"))
    assert err.value.message == (
        "policy rule 'r' multiplies algorithm.clip_ratio_high, which this run leaves empty (it follows "
        "clip_ratio); set it in the config or use set"
    )
    with pytest.raises(ConfigError, match="adds to algorithm.clip_ratio_low, which this run leaves empty"):
        load_config(policy_cfg(tmp_path, "{type: adjust, add: {algorithm.clip_ratio_low: 0.01}}"))
    set_ok = load_config(policy_cfg(tmp_path, "{type: adjust, set: {algorithm.clip_ratio_high: 0.28}}"))
    given = load_config(
        policy_cfg(tmp_path, "{type: adjust, multiply: {algorithm.clip_ratio_high: 1.1}}"),
        ["algorithm.clip_ratio_high=0.28"],
    )
    assert set_ok.policies and given.algorithm.clip_ratio_high == 0.28


@pytest.mark.parametrize(
    "action,message",
    [
        (
            "{type: adjust, multiply: {critic.lr: 0.5}}",
            "policy rule 'r' multiplies critic.lr, but algorithm.name is grpo, which has no critic (the critic "
            "settings apply to ppo): it would do nothing",
        ),
        (
            "{type: adjust, add: {algorithm.kl_ctrl.target_kl: -0.005}}",
            "policy rule 'r' adds to algorithm.kl_ctrl.target_kl, but algorithm.kl_ctrl.type is fixed (target_kl "
            "steers the adaptive controller only): it would do nothing",
        ),
        (
            "{type: adjust, set: {actor.lr: 0}}",
            "policy rule 'r' sets actor.lr to 0, outside actor.lr's legal values (> 0)",
        ),
        (
            "{type: adjust, set: {algorithm.clip_ratio: 1.5}}",
            "policy rule 'r' sets algorithm.clip_ratio to 1.5, outside algorithm.clip_ratio's legal values (> 0 and < 1)",
        ),
        (
            "{type: adjust, add: {algorithm.clip_ratio: 0.1}, max: {algorithm.clip_ratio: 1.5}}",
            "policy rule 'r' bounds algorithm.clip_ratio with max 1.5, outside algorithm.clip_ratio's legal values "
            "(> 0 and < 1)",
        ),
        (
            "{type: adjust, multiply: {algorithm.clip_ratio_c: 0.5}, min: {algorithm.clip_ratio_c: 1}}",
            "policy rule 'r' bounds algorithm.clip_ratio_c with min 1, outside algorithm.clip_ratio_c's legal values (> 1)",
        ),
    ],
)
def test_an_adjustment_that_would_do_nothing_or_leave_the_domain_is_a_config_error(tmp_path, action, message):
    with pytest.raises(ConfigError) as err:
        load_config(policy_cfg(tmp_path, action))
    assert err.value.message == message


def test_critic_and_target_kl_knobs_are_accepted_where_they_act(tmp_path):
    ppo = ["algorithm.name=ppo", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_coef=0.05"]
    action = "{type: adjust, multiply: {critic.lr: 0.5, algorithm.kl_ctrl.target_kl: 0.5}}"
    assert load_config(policy_cfg(tmp_path, action), ppo).policies
    sched = "schedules:\n  critic.lr: {schedule: [{value: 1.0e-5}]}\n  algorithm.kl_ctrl.target_kl: {schedule: [{value: 0.1}]}\n"
    assert set(load_config(write(tmp_path, sched), ppo).schedules) == {"critic.lr", "algorithm.kl_ctrl.target_kl"}
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, sched))
    assert err.value.message == (
        "invalid config: 'schedules' (run.yaml line 1): critic.lr has a schedule, but algorithm.name is grpo, which "
        "has no critic (the critic settings apply to ppo): it would do nothing."
    )
    with pytest.raises(
        ConfigError, match="algorithm.kl_ctrl.target_kl has a schedule, but algorithm.kl_ctrl.type is fixed"
    ):
        load_config(write(tmp_path, sched), ["algorithm.name=ppo"])


def test_an_expression_watching_a_validation_metric_needs_validation(tmp_path):
    p = policy_cfg(tmp_path, "{type: warn}", when="val/score/mean * 2 < actor/entropy")
    with pytest.raises(ConfigError, match="watches val/score/mean, but this run never validates"):
        load_config(p)
    cfg = load_config(p, ["trainer.val_every=2"])
    check_policies_fit(cfg, load_policies(cfg.policies))


# -- adjustments of unscheduled and scheduled knobs -----------------------------------------------------
def test_a_bounded_add_fired_twice_stops_at_its_max():
    cfg = RunConfig()
    seen = []
    for _ in range(3):
        new, note = adjust_knob(cfg, "algorithm.kl_coef", cfg.algorithm.kl_coef, "add", 0.01, None, 0.015)
        seen.append((new, note))
    assert seen == [(0.01, None), (0.015, None), (0.015, None)]
    assert cfg.algorithm.kl_coef == 0.015


def test_an_adjustment_that_would_leave_the_domain_is_held_and_says_so():
    cfg = RunConfig()
    new, note = adjust_knob(cfg, "algorithm.clip_ratio", 0.2, "multiply", 10.0)
    assert new == cfg.algorithm.clip_ratio == math.nextafter(1.0, 0.0)
    assert "outside algorithm.clip_ratio's legal values (> 0 and < 1)" in note
    new, _ = adjust_knob(cfg, "algorithm.kl_ctrl.target_kl", 0.1, "add", -0.5, 0.01)  # the action's min first
    assert new == 0.01
    new, note = adjust_knob(cfg, "algorithm.clip_ratio_high", None, "set", 0.28)
    assert (new, note, cfg.algorithm.clip_ratio_high) == (0.28, None, 0.28)


def test_an_adjustment_of_a_scheduled_knob_changes_its_composition_and_the_values_at_every_later_step():
    cfg = validate_config(
        {
            "trainer": {"total_steps": 10},
            "algorithm": {"kl_coef": {"schedule": [{"until": 0.4, "value": 0.0}, {"value": 0.002}]}},
        }
    )
    new, _ = adjust_knob(cfg, "algorithm.kl_coef", 0.0, "multiply", 0.5, step=6)
    assert new == 0.001 and cfg.schedules["algorithm.kl_coef"].scale == 0.5
    adjust_knob(cfg, "algorithm.kl_coef", 0.001, "add", 0.0005, None, 0.0012, step=6)
    values = []
    for step in range(1, 11):
        follow_schedules(cfg, step)
        values.append(cfg.algorithm.kl_coef)
    assert values == [0.0005] * 4 + [0.0012] * 6  # clamp(sched * 0.5 + 0.0005, max=0.0012)
    # what a resume reads back from RUN_DIR/config.yaml gives the same values at the same steps
    again = validate_config(yaml.safe_load(cfg.to_yaml()))
    assert [again.schedules["algorithm.kl_coef"].value_at(s, 10) for s in range(1, 11)] == values


# -- resume --set ----------------------------------------------------------------------------------------
def test_resume_set_takes_nested_knobs_and_a_number_replaces_a_schedule():
    cfg = validate_config({"algorithm": {"kl_coef": {"schedule": [{"until": 0.5, "value": 0.0}, {"value": 0.01}]}}})
    new, changes = apply_resume_overrides(cfg, ["actor.grad_clip=0.5", "algorithm.kl_coef=0.02"])
    assert changes == {"actor.grad_clip": {"from": 1.0, "to": 0.5}, "algorithm.kl_coef": {"from": 0.0, "to": 0.02}}
    assert new.actor.grad_clip == 0.5 and new.schedules == {}
    adaptive = validate_config({"algorithm": {"kl_coef": 0.05, "kl_ctrl": {"type": "adaptive"}}})
    new, changes = apply_resume_overrides(adaptive, ["algorithm.kl_ctrl.target_kl=0.05"])
    assert changes == {"algorithm.kl_ctrl.target_kl": {"from": 0.1, "to": 0.05}}
    new, changes = apply_resume_overrides(new, ["actor.lr={schedule: [{value: 2.0e-6}]}"])
    assert changes["actor.lr"]["to"]["schedule"] == [{"until": None, "value": 2e-6}]
    assert "actor.lr" in new.schedules
    with pytest.raises(ConfigError, match="'actor.zero_stage' cannot change on resume"):
        apply_resume_overrides(new, ["actor.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"'algorithm.kl_ctrl.target_kl' \(--set algorithm.kl_ctrl.target_kl=-1\)"):
        apply_resume_overrides(new, ["algorithm.kl_ctrl.target_kl=-1"])


def test_resume_set_refuses_a_knob_the_run_does_not_use():
    grpo = validate_config({})
    with pytest.raises(ConfigError, match=r"'--set critic.lr' would do nothing: algorithm.name is grpo, which has no"):
        apply_resume_overrides(grpo, ["critic.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"'--set algorithm.kl_ctrl.target_kl' would do nothing: .* is fixed"):
        apply_resume_overrides(grpo, ["algorithm.kl_ctrl.target_kl=0.05"])
    ppo = validate_config({"algorithm": {"name": "ppo"}})
    assert apply_resume_overrides(ppo, ["critic.lr=1e-5"])[0].critic.lr == 1e-5


def test_resume_set_takes_a_multi_turn_runs_tool_settings_and_refuses_them_without_tools():
    mt = {"tools": [{"function": "toolbox:lookup"}]}
    tools = validate_config({"data": {"apply_chat_template": True}, "rollout": {"multi_turn": mt}})
    new, changes = apply_resume_overrides(tools, ["rollout.multi_turn.tool_retry_budget=10"])
    assert new.rollout.multi_turn.tool_retry_budget == 10
    assert changes == {"rollout.multi_turn.tool_retry_budget": {"from": 3, "to": 10}}
    with pytest.raises(
        ConfigError, match="'rollout.multi_turn.tool_timeout_s' cannot be set: this run has no 'rollout.multi_turn'"
    ):
        apply_resume_overrides(validate_config({}), ["rollout.multi_turn.tool_timeout_s=5"])


# -- the engine follows the gradient clip and weight decay (real DeepSpeed) -----------------------------
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_new_grad_clip_is_the_one_deepspeed_applies(runtime, stage):
    from rlctl.engine.ds_module import DSModule, EngineSpec

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8, bias=False))
    module = DSModule(model, EngineSpec(lr=1e-3, zero_stage=stage, grad_clip=1e6, mini_batch=1, micro_batch=1), runtime)
    x = torch.ones(1, 8)

    def step_and_clipped_norm() -> float:
        """One optimizer step on a loss of gradient norm ~ 1e3; AdamW's first moment holds the
        gradient after clipping: exp_avg = (1 - beta1) * g on the first step."""
        adamw = getattr(module.optimizer, "optimizer", module.optimizer)  # (stage 0 in fp32: no wrapper)
        for state in adamw.state.values():
            state.clear()
        module.step(module.engine(x).sum() * 100)
        avg = [s["exp_avg"] for s in adamw.state.values()]
        return float(torch.sqrt(sum((a.float() ** 2).sum() for a in avg))) / 0.1

    assert step_and_clipped_norm() > 100  # clip 1e6: nothing clipped
    module.set_knobs(lr=1e-3, grad_clip=0.5, weight_decay=0.25)
    assert step_and_clipped_norm() == pytest.approx(0.5, rel=1e-4)
    assert module.engine.gradient_clipping() == 0.5
    assert {g["weight_decay"] for g in module.optimizer.param_groups} == {0.25}
