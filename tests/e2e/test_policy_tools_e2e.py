"""`rlctl policy replay`, `calibrate` and `check` on two real runs (the installed `rlctl`, the tiny
built-in model): a drilled run whose KL spikes are rolled back, replayed with the policy it ran under;
a healthy run calibrated into a policy that check accepts and that never fires on it."""

import json

import pytest
import yaml

from rlctl.errors import ExitCode
from rlctl.policies import validate_policy
from rlctl.policies.catalogue import known_metric

from helpers import REPO, SMALL, drills, events_of, invoke, metrics_of, start_args

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("drilled", "healthy")

# two update passes per step (mini-batch 8 of 16 responses), so actor/ppo_kl is not always 0
SHAPE = [*SMALL, "--set", "actor.mini_batch_size=8"]
RULES = [
    {
        "name": "kl",
        "when": "actor/ppo_kl > 1.0",
        "actions": [{"type": "rollback"}, {"type": "adjust", "multiply": {"actor.lr": 0.5}}],
        "max_triggers": 2,
    },
    {"name": "kl-watch", "when": "actor/ppo_kl > 0.5", "actions": [{"type": "warn"}]},
]


def finished_run(tmp_path_factory, name, config, faults=""):
    run = tmp_path_factory.mktemp(name) / "run"
    r = invoke("start", *start_args(run, config=config), *SHAPE, *drills(faults), cwd=REPO)
    assert r.returncode == 0, r.stderr
    return run


@pytest.fixture(scope="module")
def drilled(tmp_path_factory):
    """KL drilled to 5.0 at steps 3 and 6; each is rolled back (a snapshot every step)."""
    config = {"trainer": {"total_steps": 8}, "checkpoint": {"every": 1}, "policies": [{"rules": RULES}]}
    return finished_run(tmp_path_factory, "drilled", config, "metric@3=actor/ppo_kl:5.0,metric@6=actor/ppo_kl:5.0")


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return finished_run(tmp_path_factory, "healthy", {"trainer": {"total_steps": 10}})


def live_firings(run):
    return [
        {k: v for k, v in e.items() if k not in ("time", "event")} for e in events_of(run) if e["event"] == "policy"
    ]


def test_replay_lists_exactly_the_live_firings(drilled, tmp_path):
    live = live_firings(drilled)
    assert [(f["rule"], f["step"], f["count"]) for f in live] == [
        ("kl", 3, 1),
        ("kl-watch", 3, 1),
        ("kl", 6, 2),
        ("kl-watch", 6, 2),
    ]
    assert [e["to_step"] for e in events_of(drilled) if e["event"] == "rollback"] == [2, 5]
    policy = tmp_path / "kl.yaml"
    policy.write_text(yaml.safe_dump({"rules": RULES}))
    for args in ([], ["--policy", str(policy)]):  # the run's own policies, or the file
        r = invoke("policy", "replay", str(drilled), *args, "--format", "json")
        assert r.returncode == 0, r.stderr
        replayed = json.loads(r.stdout)
        assert [{k: v for k, v in f.items() if k != "turned_away"} for f in replayed] == live
        assert {f["turned_away"] for f in replayed} == {"rollback"}  # each firing's row was rolled back
    table = invoke("policy", "replay", str(drilled))
    assert table.stdout.splitlines()[-2:] == [
        "kl: fired 2 times, at steps 3, 6",
        "kl-watch: fired 2 times, at steps 3, 6",
    ]
    assert "replayed 10 rows" in table.stderr and "(2 abandoned)" in table.stderr


def test_calibrated_policy_is_valid_and_quiet_on_its_run(healthy, tmp_path):
    r = invoke("policy", "calibrate", str(healthy))
    assert r.returncode == 0, r.stderr
    mine = tmp_path / "mine.yaml"
    mine.write_text(r.stdout)
    policy = validate_policy(yaml.safe_load(r.stdout))
    names = [rule.name for rule in policy.rules]
    assert names[:3] == ["kl", "grad-spike", "entropy-floor"]  # what every run has
    assert r.stdout.count("# replayed on this run: fires 0 times") == len(names)
    assert "calibrated on 10 rows" in r.stderr
    checked = invoke("policy", "check", str(mine), "--run", str(healthy), "--strict")
    assert checked.returncode == 0 and "warning" not in checked.stderr, checked.stderr
    assert f"{mine}: valid, {len(names)} rules." in checked.stdout
    replayed = invoke("policy", "replay", str(healthy), "--policy", str(mine), "--format", "json")
    assert replayed.returncode == 0 and json.loads(replayed.stdout) == [], replayed.stdout


def test_check_warns_about_metrics_no_run_writes(healthy, tmp_path):
    typo = tmp_path / "typo.yaml"
    rules = [
        {"name": "kl", "when": "actor/ppo_kll > 0.1", "actions": [{"type": "warn"}]},
        {"name": "val", "when": "val/score/mean < 0.1", "actions": [{"type": "warn"}]},
    ]
    typo.write_text(yaml.safe_dump({"rules": rules}))
    r = invoke("policy", "check", str(typo))
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == [
        f"warning: {typo}: rule kl reads 'actor/ppo_kll', which no rlctl run writes (did you mean 'actor/ppo_kl'?)"
    ]
    strict = invoke("policy", "check", str(typo), "--strict")
    assert strict.returncode == ExitCode.CONFIG and "--strict: the rules read 1 metric name that" in strict.stderr
    against = invoke("policy", "check", str(typo), "--run", str(healthy))
    assert against.returncode == 0
    lines = against.stderr.splitlines()
    assert len(lines) == 2 and all(f"which run {healthy} never wrote" in line for line in lines)
    assert "(did you mean 'actor/ppo_kl'?)" in lines[0] and "rule val reads 'val/score/mean'" in lines[1]
    assert "(rlctl writes it where the run's config asks for it: mean score of every validation answer)" in lines[1]


def test_every_key_a_real_run_writes_is_catalogued(healthy, drilled):
    keys = {
        k
        for run in (healthy, drilled)
        for rel in ("metrics.jsonl", "metrics.abandoned.jsonl")
        for r in metrics_of(run, rel)
        for k in r
    }
    keys -= {"step", "timestamp", "abandoned"}
    assert "actor/ppo_kl" in keys and "timing_s/gen" in keys
    assert sorted(k for k in keys if not known_metric(k)) == []
    assert "perf/tokens" not in keys  # declared by the trainer, folded into perf/tokens_seen
