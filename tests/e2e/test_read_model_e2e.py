"""One reading and one replay of a real run (the installed `rlctl`, the tiny built-in model) with a
rollback and a resume: `rlctl inspect --check --policy P` warns about the last firing that `rlctl policy
replay RUN --policy P` lists, for the policy the run ran under and for one it did not."""

import json

import pytest
import yaml

from helpers import SMALL, events_of, invoke, metrics_of, run_cli, start_args

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("turned",)

RAN_UNDER = [{"name": "kl", "when": "actor/ppo_kl > 1.0", "actions": [{"type": "rollback"}]}]
WATCH = [
    {"name": "kl-watch", "when": "actor/ppo_kl > 0.5", "actions": [{"type": "warn"}]},
    {"name": "grad-watch", "when": "actor/grad_norm > 1000", "actions": [{"type": "warn"}]},
]


@pytest.fixture(scope="module")
def turned(tmp_path_factory):
    """KL drilled at step 3 (rolled back to 2), a grad-norm drilled at step 5, then a crash after step 5
    (the last snapshot is step 4) and a resume that turns away from step 5."""
    run = tmp_path_factory.mktemp("turned") / "run"
    faults = "metric@3=actor/ppo_kl:5.0,metric@5=actor/grad_norm:1000000.0,crash@5"
    config = {"policies": [{"rules": RAN_UNDER}]}
    r = run_cli("start", *start_args(run, config=config, steps=6, every=2), *SMALL, faults=faults)
    assert r.returncode != 0 and "crashed after step 5" in r.stderr, r.stderr
    r = invoke("resume", str(run))  # (in this process: what the tests read is the turn it makes)
    assert r.returncode == 0, r.stderr
    return run


def policy_file(tmp_path, name, rules):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"rules": rules}))
    return str(path)


def test_the_run_has_a_rollback_and_a_resume(turned):
    assert [e["to_step"] for e in events_of(turned, "rollback")] == [2]
    abandoned = metrics_of(turned, "metrics.abandoned.jsonl")
    assert [(a["step"], a["abandoned"]["event"]) for a in abandoned] == [(3, "rollback"), (5, "resume")]
    assert [r["step"] for r in metrics_of(turned)] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize(
    ("rules", "last"),
    [(RAN_UNDER, ("kl", 3, "rollback")), (WATCH, ("grad-watch", 5, "resume"))],
    ids=["ran-under", "watch"],
)
def test_check_and_replay_agree_on_the_last_firing(turned, tmp_path, rules, last):
    policy = policy_file(tmp_path, "p", rules)
    replayed = invoke("policy", "replay", str(turned), "--policy", policy, "--format", "json")
    assert replayed.returncode == 0, replayed.stderr
    firings = json.loads(replayed.stdout)
    assert (firings[-1]["rule"], firings[-1]["step"], firings[-1]["turned_away"]) == last
    check = invoke("inspect", str(turned), "--check", "--policy", policy)
    assert check.returncode == 41, check.stdout + check.stderr  # a warning
    assert check.stdout.strip() == (
        f"WARNING {turned} at step 6/6: rule '{firings[-1]['rule']}' fired at step {firings[-1]['step']}"
    )
