"""rlctl inspect and rlctl runs: golden outputs on run directories written here (local, memory://, S3),
through the command group in this process (the real entry point in a subprocess where a fresh process's
environment is the point). Every --check exit code from a real run: tests/e2e/test_inspect_check_exit_codes.py."""

import json
import subprocess
import sys
import uuid

import orjson
import pytest
from click.testing import CliRunner

from rlctl.cli import cli
from rlctl.config import RunConfig
from rlctl.rundir.summary import sparkline
from rlctl.storage import Storage

from helpers import invoke, run_cli


def make_run(url, steps=5, events=(), tail=b""):
    """A run directory as rlctl writes one, without training."""
    run = Storage(url)
    cfg = RunConfig.model_validate({"trainer": {"total_steps": steps}})
    run.write_bytes("config.yaml", cfg.to_yaml().encode())
    rows = [
        {
            "step": i,
            "timestamp": 1_700_000_000.0 + i,
            "critic/score/mean": i / 10,
            "actor/ppo_kl": 0.001 * i,
            "actor/grad_norm": 1.5,
            "actor/entropy": float("nan") if i == 3 else 2.0,
        }
        for i in range(1, steps + 1)
    ]
    from rlctl.metrics import dumps_row

    run.write_bytes("metrics.jsonl", b"".join(dumps_row(r) for r in rows) + tail)
    run.write_bytes("events.jsonl", b"".join(orjson.dumps(e) + b"\n" for e in [{"event": "start"}, *events]))
    return url


def inspect(*args):
    result = CliRunner().invoke(cli, ["inspect", *args], catch_exceptions=False)
    return result


@pytest.fixture
def done_run(tmp_path):
    return make_run(str(tmp_path / "r"), events=[{"event": "completed", "step": 5}])


def test_csv_jsonl_json_and_table_goldens(done_run):
    r = inspect(
        done_run, "--metrics", "critic/*,actor/entropy", "--since-step", "2", "--until-step", "4", "--format", "csv"
    )
    assert r.exit_code == 0
    assert r.stdout == "step,critic/score/mean,actor/entropy\n2,0.2,2\n3,0.3,NaN\n4,0.4,2\n"

    r = inspect(done_run, "--metrics", "actor/ppo_kl", "--last", "2", "--format", "jsonl")
    assert r.stdout == '{"step":4,"actor/ppo_kl":0.004}\n{"step":5,"actor/ppo_kl":0.005}\n'

    r = inspect(done_run, "--metrics", "actor/entropy", "--every", "3", "--format", "json")
    assert json.loads(r.stdout) == [{"step": 3, "actor/entropy": "NaN"}]

    r = inspect(done_run, "--metrics", "actor/grad_norm", "--last", "2")
    assert r.stdout == "step  actor/grad_norm\n4     1.5\n5     1.5\n"


def test_summary_and_events(done_run):
    r = inspect(done_run)
    assert r.exit_code == 0
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["status", "completed"] and lines[2].split() == ["step", "5", "/", "5"]
    assert "snapshot   none (last good: none)" in r.stdout
    score = next(line for line in lines if line.startswith("critic/score/mean"))
    assert score.split()[1:] == ["0.5", "▁▃▄▆█"]
    summary = json.loads(inspect(done_run, "--format", "json").stdout)
    assert summary["status"] == "completed" and summary["metrics"]["actor/ppo_kl"]["latest"] == 0.005

    r = inspect(done_run, "--events", "--format", "csv")
    assert r.stdout == "time,event,step,details\n,start,,{}\n,completed,5,{}\n"


def test_sparkline():
    assert sparkline([1, 2, 3, 4]) == "▁▃▆█"  # levels 0, 7/3, 14/3, 7 rounded
    assert sparkline([5, 5, 5]) == "▁▁▁"
    assert sparkline([1, float("nan"), 3]) == "▁!█"
    assert len(sparkline(list(range(1000)), width=24)) == 24


def test_truncated_last_line_is_tolerated_and_reported(tmp_path):
    url = make_run(str(tmp_path / "r"), events=[{"event": "completed", "step": 5}], tail=b'{"step": 6, "actor/pp')
    r = inspect(url, "--metrics", "actor/ppo_kl", "--format", "csv")
    assert r.exit_code == 0
    assert r.stdout.splitlines()[-1] == "5,0.005"
    assert (
        r.stderr
        == f"warning: skipped 1 unreadable line of {url}/metrics.jsonl (line 6): a crash mid-write, or an edit by hand\n"
    )


@pytest.mark.slow
def test_malformed_rows_and_events_are_skipped_with_one_warning_per_file(tmp_path):
    """Lines that are not JSON, not objects, or metric rows without an integer step are skipped; each file
    with such lines gets one warning naming it and the count; every view of the run still works."""
    url = make_run(str(tmp_path / "r"), events=[{"event": "completed", "step": 5}])
    run = tmp_path / "r"
    with open(run / "metrics.jsonl", "ab") as fh:
        fh.write(b'garbage\n[1, 2]\n{"critic/score/mean": 9}\n{"step": "7"}\n42\n{"step": 6, "critic/score/')
    with open(run / "events.jsonl", "ab") as fh:
        fh.write(b'{"event": "snapshot_committed", "step": "x"}\nnot json\n["event"]\n')
    r = inspect(url)
    assert r.exit_code == 0, r.output
    assert "status     completed" in r.stdout and "step       5 / 5" in r.stdout
    warnings = r.stderr.splitlines()
    assert warnings == [
        f"warning: skipped 6 unreadable lines of {url}/metrics.jsonl (lines 6, 7, 8, 9, 10, ...): "
        "a crash mid-write, or an edit by hand",
        f"warning: skipped 2 unreadable lines of {url}/events.jsonl (lines 4, 5): a crash mid-write, or an edit by hand",
    ]
    for args in (["--check"], ["--events", "--format", "csv"], ["--last", "1", "--format", "jsonl"], ["--follow"]):
        r = inspect(url, *args)
        assert r.exit_code == 0, (args, r.output)
    assert inspect(url, "--last", "1", "--format", "jsonl").stdout.startswith('{"step":5,')
    png = tmp_path / "m.png"
    assert inspect(url, "--plot", str(png)).exit_code == 0
    r = CliRunner().invoke(cli, ["runs", str(tmp_path)])
    assert r.exit_code == 0 and "completed" in r.stdout and "metrics.jsonl" in r.stderr


@pytest.mark.parametrize(
    "text, cause, listed",
    [
        (b"trainer: [unclosed\n", "is not valid YAML (line 2)", "unreadable"),
        (b"- a\n- b\n", "holds a list, not a config mapping", "unreadable"),
        (b"name: caf\xe9\n", "is not valid YAML", "unreadable"),
        (b"trainer: {total_steps: many}\n", "trainer.total_steps", "completed"),
    ],
)
def test_malformed_config_is_one_sentence_naming_the_file(tmp_path, text, cause, listed):
    """inspect (a summary validates the config), checkpoints, resume: exit 3 and one line naming
    config.yaml; runs lists a run whose config is not YAML as unreadable, with a warning (and one that is
    YAML with the status its events give)."""
    url = make_run(str(tmp_path / "r"), events=[{"event": "completed", "step": 5}])
    (tmp_path / "r" / "config.yaml").write_bytes(text)
    for args in (["inspect", url], ["checkpoints", url], ["resume", url]):
        r = invoke(*args)
        assert r.returncode == 3, (args, r.stderr)
        error = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
        assert len(error) == 1 and error[0].startswith(f"Error: {url}/config.yaml") and cause in error[0], r.stderr
        assert r.stderr.endswith(error[0] + "\n") and "Traceback" not in r.stderr, r.stderr
    r = invoke("runs", str(tmp_path), "--format", "json")
    assert r.returncode == 0, r.stderr
    assert [(x["run"], x["status"]) for x in json.loads(r.stdout)] == [(url, listed)]
    assert (f"{url}/config.yaml" in r.stderr) == (listed == "unreadable")


@pytest.mark.slow
def test_memory_and_s3_run_directories(s3_env):
    url = make_run(f"memory://inspect-{uuid.uuid4().hex}/r", events=[{"event": "completed", "step": 5}])
    assert (
        inspect(url, "--metrics", "actor/ppo_kl", "--last", "1", "--format", "csv").stdout
        == "step,actor/ppo_kl\n5,0.005\n"
    )
    assert inspect(url, "--check").exit_code == 0

    env, opts = s3_env
    s3 = "s3://rlctl-runs/inspect/r1"
    storage_opts = {k: v for k, v in opts.items()}
    import fsspec.config

    fsspec.config.conf["s3"] = storage_opts  # as FSSPEC_S3 would give it, in this process
    try:
        make_run(s3, events=[{"event": "completed", "step": 5}])
        r = run_cli("inspect", s3, "--metrics", "critic/score/mean", "--last", "2", "--format", "csv", env=env)
        assert r.returncode == 0, r.stderr
        assert r.stdout == "step,critic/score/mean\n4,0.4\n5,0.5\n"
        r = run_cli("runs", "s3://rlctl-runs/inspect", "--format", "json", env=env)
        assert [(x["run"], x["status"]) for x in json.loads(r.stdout)] == [(s3, "completed")]
    finally:
        fsspec.config.conf.pop("s3", None)


def test_plot_and_runs(tmp_path, done_run):
    png = tmp_path / "m.png"
    r = inspect(done_run, "--plot", str(png), "--metrics", "critic/score/mean,actor/grad_norm")
    assert r.exit_code == 0 and r.stdout == f"{png}\n"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    make_run(str(tmp_path / "other"), events=[{"event": "halted", "step": 2, "rule": "kl"}])
    r = CliRunner().invoke(cli, ["runs", str(tmp_path)])
    assert r.exit_code == 0
    table = {line.split()[0]: line.split()[1:3] for line in r.stdout.splitlines()[1:]}
    assert table == {done_run: ["completed", "5/5"], str(tmp_path / "other"): ["halted", "5/5"]}


@pytest.mark.slow
def test_follow_prints_every_row_of_a_finished_run(done_run):
    r = inspect(done_run, "--follow", "--metrics", "actor/ppo_kl", "--format", "csv")
    assert r.exit_code == 0 and r.stdout.splitlines() == [
        "step,actor/ppo_kl",
        *[f"{i},{i / 1000:g}" for i in range(1, 6)],
    ]


def test_inspect_never_imports_torch(done_run):
    code = (
        "import sys\nfrom click.testing import CliRunner\nfrom rlctl.cli import cli\n"
        f"r = CliRunner().invoke(cli, ['inspect', {done_run!r}])\nassert r.exit_code == 0, r.output\n"
        f"r = CliRunner().invoke(cli, ['inspect', {done_run!r}, '--check'])\n"
        "heavy = [m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules]\nassert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
