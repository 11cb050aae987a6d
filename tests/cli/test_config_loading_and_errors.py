"""Config loading: defaults, file, --set, and one located sentence for every kind of bad input."""

import subprocess
import sys
import textwrap

import pytest
from pydantic import BaseModel

from rlctl.cli import main
from rlctl.config import DEMO_CONFIG, RunConfig, load_config
from rlctl.errors import ConfigError, ExitCode


def write(tmp_path, text, name="run.yaml"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def test_defaults_and_demo():
    cfg = load_config()  # the packaged built-in config: the task, no snapshots, policies or validation
    assert cfg.name == "demo" and cfg.model.path is None and cfg.data.path is None
    assert (cfg.policies, cfg.checkpoint.every, cfg.validates, cfg.faults) == ([], 0, False, None)
    assert RunConfig().algorithm.kl_estimator == "k3"


def test_file_holds_only_differences_and_set_overrides_are_typed(tmp_path):
    p = write(tmp_path, "actor:\n  lr: 1.0e-4\n")
    cfg = load_config(p, ["trainer.total_steps=40", "actor.lr=5e-5", "actor.betas=[0.8, 0.9]", "algorithm.kl_coef=0"])
    assert cfg.trainer.total_steps == 40
    assert cfg.actor.lr == 5e-5  # YAML reads 5e-5 as a string; the schema types it
    assert cfg.actor.betas == (0.8, 0.9)
    assert cfg.actor.zero_stage == RunConfig().actor.zero_stage  # untouched default


@pytest.mark.parametrize(
    "text,sets,message",
    [
        ("actor:\n  lrr: 0.1\n", [], "unknown key 'actor.lrr' (run.yaml line 2); did you mean 'actor.lr'?"),
        ("actr:\n  lr: 0.1\n", [], "unknown key 'actr' (run.yaml line 1); did you mean 'actor'?"),
        (
            "seed: 1\n",
            ["trainer.total_step=3"],
            "unknown key 'trainer.total_step' (--set trainer.total_step=3); did you mean 'trainer.total_steps'?",
        ),
        ("actor:\n  lr: fast\n", [], "'actor.lr' (run.yaml line 2): input should be a valid number"),
        ("actor:\n  zero_stage: 4\n", [], "'actor.zero_stage' (run.yaml line 2): input should be 0, 1, 2 or 3"),
        (
            "algorithm:\n  kl_estimator: k4\n",
            [],
            "'algorithm.kl_estimator' (run.yaml line 2): input should be 'k1', 'k2' or 'k3'",
        ),
        ("reward:\n  function: just_a_name\n", [], "'reward.function' (run.yaml line 2): expected 'module:function'"),
        (
            "trainer:\n  total_steps: 0\n",
            [],
            "'trainer.total_steps' (run.yaml line 2): input should be greater than or equal to 1",
        ),
        ("trainer: 5\n", [], "'trainer' (run.yaml line 1): input should be a valid dictionary"),
        (
            "actor:\n  micro_batch_size: 4\n  max_tokens_per_micro_batch: 512\n",
            [],
            "'actor' (run.yaml line 1): set actor.micro_batch_size or actor.max_tokens_per_micro_batch, not both",
        ),
        ("- a\n- b\n", [], "run.yaml must be a mapping of keys to values, got list"),
        ("actor: {lr: [1, 2\n", [], "run.yaml line 2 is not valid YAML"),
        ("seed: 1\n", ["actor.lr"], "--set expects KEY=VALUE, got 'actor.lr'"),
        ("seed: -1\n", [], "'seed' (run.yaml line 1): input should be greater than or equal to 0 (got -1)"),
        (
            "policies:\n  - rules:\n      - name: nan\n        trigger: {kind: nonfinite}\n"
            "        actions: [{type: rollback}]\n",
            [],
            "policy rule 'nan' rolls back, but 'checkpoint.every' is 0: there would be no snapshot to roll back to",
        ),
    ],
)
def test_bad_config_is_one_located_sentence(tmp_path, text, sets, message):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(p, sets)
    assert message in err.value.message


@pytest.mark.parametrize(
    "text,sets,message",
    [
        ("model:\n  path: /no/such/dir\n", [], "'model.path' (run.yaml line 2): no such model directory: /no/such/dir"),
        ("data:\n  path: /no/such.jsonl\n", [], "'data.path' (run.yaml line 2): no such file: /no/such.jsonl"),
        (
            "checkpoint:\n  dir: s4://bucket/ckpt\n",
            [],
            "'checkpoint.dir' (run.yaml line 2): unknown storage protocol 's4://' in 's4://bucket/ckpt'; "
            "did you mean s3:// or gs://?",
        ),
        (
            "seed: 1\n",
            ["checkpoint.dir=filecache::gcz://b"],
            "unknown storage protocol 'gcz://' in 'filecache::gcz://b'; did you mean gcs://",
        ),
    ],
)
def test_what_a_config_names_on_this_machine_is_checked_before_a_start_in_the_same_located_sentence(
    tmp_path, text, sets, message
):
    """Validation checks shape and values only (a run's saved config reads on any machine); the files,
    directories and storage protocol a config names are the preflight's, located as validation would."""
    from rlctl.preflight import check_config_names

    cfg = load_config(write(tmp_path, text), sets)
    with pytest.raises(ConfigError) as err:
        check_config_names(cfg)
    assert err.value.message.startswith("invalid config: ") and message in err.value.message


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")


def test_cli_renders_config_error_without_traceback(tmp_path, capsys):
    p = write(tmp_path, "actor:\n  lrr: 0.1\n")
    with pytest.raises(SystemExit) as exit_:
        main(["start", str(p), "--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == ExitCode.CONFIG == 3
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("Error: invalid config: unknown key 'actor.lrr' (run.yaml line 2); did you mean 'actor.lr'?\n")
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    "text,message",
    [
        (
            "seed: -1\n",
            "invalid config: 'seed' (run.yaml line 1): input should be greater than or equal to 0 (got -1).",
        ),
        (
            "checkpoint:\n  dir: s4://bucket/ckpt\n",
            "invalid config: 'checkpoint.dir' (run.yaml line 2): unknown storage protocol 's4://' in "
            "'s4://bucket/ckpt'; did you mean s3:// or gs://?",
        ),
        (
            "data:\n  path: /no/such.jsonl\n",
            "invalid config: 'data.path' (run.yaml line 2): no such file: /no/such.jsonl.",
        ),
        (
            "checkpoint:\n  every: 5\npolicies: [val-drop]\n",
            "policy rule 'val-drop' watches val/score/mean, but this run never validates: set trainer.val_every "
            "to N > 0 (validate every N steps)",
        ),
        (
            "policies: [default]\n",
            "policy rule 'nonfinite' rolls back, but 'checkpoint.every' is 0: there would be no snapshot to roll "
            "back to; set checkpoint.every to N > 0 (snapshot every N steps)",
        ),
    ],
)
def test_config_mistakes_found_before_any_work_leave_nothing(tmp_path, capsys, text, message):
    p = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_:
        main(["start", str(p), "--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == ExitCode.CONFIG
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"Error: {message}\n")
    assert not (tmp_path / "run").exists()


def test_trackers_need_a_local_run_directory(tmp_path, capsys):
    p = write(tmp_path, "trainer:\n  loggers: [tensorboard]\n")
    with pytest.raises(SystemExit) as exit_:
        main(["start", str(p), "--run-dir", "memory://tracked"])
    assert exit_.value.code == ExitCode.CONFIG
    assert capsys.readouterr().err.splitlines()[-1] == (
        "Error: 'trainer.loggers' (tensorboard) write into the run directory, which must be local; "
        "memory://tracked is not (snapshots may still go to object storage: checkpoint.dir)"
    )


def test_a_rollback_policy_with_snapshots_is_accepted(tmp_path):
    cfg = load_config(write(tmp_path, "policies: [default]\ncheckpoint:\n  every: 5\n"))
    assert cfg.policies[0]["rules"][0]["name"] == "nonfinite"


def test_a_config_file_that_is_not_utf8_names_the_byte(tmp_path, capsys):
    p = tmp_path / "run.yaml"
    p.write_bytes(b"name: caf\xe9\nseed: 1\n")
    with pytest.raises(SystemExit) as exit_:
        main(["start", str(p), "--run-dir", str(tmp_path / "run")])
    assert exit_.value.code == ExitCode.CONFIG
    assert capsys.readouterr().err == (
        f"Error: config file {p} is not UTF-8 text: byte 0xe9 at offset 9 (line 1) cannot be decoded; "
        "save it as UTF-8\n"
    )
    p.write_bytes("\ufeffname: café\n".encode())  # UTF-8 with a byte-order mark is fine
    assert load_config(p).name == "café"


def test_usage_error_exits_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["start", "--bogus"])
    assert exit_.value.code == 2


def test_every_field_has_a_description():
    missing = []

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            if not field.description:
                missing.append(prefix + name)
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, BaseModel):
                walk(ann, f"{prefix}{name}.")

    walk(RunConfig, "")
    assert missing == []


def test_demo_config_is_valid_and_shows_what_rlctl_is_for(tmp_path, monkeypatch):
    """`rlctl start demo` (make demo) picks the packaged showcase by its bare name, unless a file of that
    name is in the way."""
    cfg = load_config("demo")
    assert cfg == load_config(DEMO_CONFIG)
    assert cfg.trainer.total_steps >= 100 and cfg.validates and cfg.checkpoint.every and cfg.checkpoint.keep_best
    assert [r["name"] for r in cfg.policies[0]["rules"]][0] == "nonfinite" and cfg.faults
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").write_text("trainer:\n  total_steps: 3\n")
    assert load_config("demo").trainer.total_steps == 3


def test_help_does_not_import_heavy_libraries():
    code = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from rlctl.cli import cli\n"
        "for args in (['--help'], ['start', '--help']):\n"
        "    r = CliRunner().invoke(cli, args)\n"
        "    assert r.exit_code == 0, r.output\n"
        "    assert 'Usage:' in r.output\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_choices_come_from_the_registries_and_load_no_torch():
    code = (
        "import sys, typing\n"
        "from rlctl.config import RunConfig\n"
        "from rlctl.algos import registry as r\n"
        "fields = RunConfig.model_fields['algorithm'].annotation.model_fields\n"
        "def choices(name):\n"
        "    ann = fields[name].annotation\n"
        "    literal = next(a for a in (ann, *typing.get_args(ann)) if typing.get_origin(a) is typing.Literal)\n"
        "    return set(typing.get_args(literal))\n"
        "assert choices('adv_estimator') == set(r.ADVANTAGES.names)\n"
        "assert choices('kl_estimator') == set(r.KL_ESTIMATORS.names) == {'k1', 'k2', 'k3'}\n"
        "assert choices('loss_agg_mode') == set(r.AGG_MODES.names)\n"
        "assert choices('importance_ratio') == set(r.POLICY_LOSS_LEVELS.names)\n"
        "assert 'torch' not in sys.modules, 'the config schema imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_yaml_of_a_changed_config_is_rendered_again():
    """to_yaml keeps the last text it made: any change of a value gives new text, inf and None too
    (the JSON form writes both as null)."""
    cfg = load_config(None, [])
    first = cfg.to_yaml()
    assert cfg.to_yaml() is first and "clip_ratio_high: null" in first
    cfg.algorithm.clip_ratio_high = float("inf")
    assert "clip_ratio_high: .inf" in cfg.to_yaml()
    cfg.algorithm.clip_ratio_high = None
    assert cfg.to_yaml() == first
    cfg.actor.lr = 0.5
    assert "lr: 0.5" in cfg.to_yaml() and load_config(None, []).to_yaml() == first


@pytest.mark.parametrize(
    "text,sets,message",
    [
        (
            "trainer:\n  total_steps: 3\nseed: 1\ntrainer:\n  total_steps: 9\n",
            [],
            "run.yaml: 'trainer' is given twice: line 1 and line 4; a key is written once in a mapping: keep one",
        ),
        (
            "actor:\n  lr: 1.0e-3\n  betas: [0.9, 0.95]\n  lr: 5.0\n",
            [],
            "run.yaml: 'actor.lr' is given twice: line 2 and line 4; a key is written once in a mapping: keep one",
        ),
        (
            "seed: 1\n",
            ["actor={lr: 0.1, lr: 0.2}"],
            "--set actor={lr: 0.1, lr: 0.2}: 'actor.lr' is given twice; a key is written once in a mapping: keep one",
        ),
    ],
)
def test_a_key_given_twice_is_a_mistake_found_before_any_work(tmp_path, capsys, text, sets, message):
    """Not the last word (PyYAML kept the last lr, trained with it and exited 0): exit 3, nothing written."""
    p = write(tmp_path, text)
    with pytest.raises(SystemExit) as exit_:
        main(["start", str(p), "--run-dir", str(tmp_path / "run"), *[f"--set={s}" for s in sets]])
    assert exit_.value.code == ExitCode.CONFIG
    assert capsys.readouterr() == ("", f"Error: {message}\n")
    assert not (tmp_path / "run").exists()


def test_a_key_given_twice_on_the_command_line_is_the_last_word(tmp_path):
    cfg = load_config(write(tmp_path, "actor:\n  lr: 0.1\n"), ["actor.lr=0.2", "actor.lr=0.3"])
    assert cfg.actor.lr == 0.3 and cfg.provenance.origins[("actor", "lr")] == "--set actor.lr=0.3"


def test_yaml_1_2_words_are_strings_and_a_boolean_where_a_string_belongs_says_so(tmp_path):
    p = write(tmp_path, "rollout:\n  stop: [no, off]\nactor:\n  lr: 1e-3\n")
    cfg = load_config(p, ["data.system_prompt=yes"])
    assert cfg.rollout.stop == ["no", "off"] and cfg.actor.lr == 0.001 and cfg.data.system_prompt == "yes"
    assert load_config(p, ["rollout.stop=[no]"]).rollout.stop == ["no"]  # (YAML 1.1 made it False: refused)
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "rollout:\n  stop: ['###', True]\n", "bool.yaml"))
    assert err.value.message == (
        "invalid config: 'rollout.stop.1' (bool.yaml line 2): a string is expected, but `True` was read as the "
        "boolean true; quote it ('True')."
    )
    with pytest.raises(ConfigError) as err:
        load_config(p, ["data.system_prompt=false"])
    assert err.value.message == (
        "invalid config: 'data.system_prompt' (--set data.system_prompt=false): a string is expected, but "
        "`false` was read as the boolean false; quote it ('false')."
    )


def test_set_into_a_list_sets_that_item_or_is_a_sentence(tmp_path):
    p = write(
        tmp_path, "rollout:\n  stop: ['###', '\\n\\n']\n  multi_turn:\n    tools: [{function: 'toolbox:lookup'}]\n"
    )
    base = ["data.apply_chat_template=true"]
    cfg = load_config(p, [*base, "rollout.stop.1=END", "rollout.multi_turn.tools.0.name=find"])
    assert cfg.rollout.stop == ["###", "END"]  # still a list: the item replaced
    assert [(t.function, t.label) for t in cfg.rollout.multi_turn.tools] == [("toolbox:lookup", "find")]
    with pytest.raises(ConfigError) as err:
        load_config(p, [*base, "rollout.stop.2=END"])
    assert err.value.message == (
        "--set rollout.stop.2=END: 'rollout.stop' is a list of 2 item(s), and '2' is none of its indices (0 to 1); "
        "set an item by its index, or the whole list (--set 'rollout.stop=[...]')"
    )
    with pytest.raises(ConfigError, match="'rollout.stop' is a list of 2 item.*'first' is none of its indices"):
        load_config(p, [*base, "rollout.stop.first=END"])
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "seed: 1\n"), ["rollout.stop.0.x=1"])
    assert err.value.message == (
        "--set rollout.stop.0.x=1: the config gives no list at 'rollout.stop' to take item 0 of; set the whole "
        "list (--set 'rollout.stop=[...]')"
    )
