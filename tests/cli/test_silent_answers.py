"""No silent answers: a policy whose limit is NaN or an infinity (it could never fire), and an `inspect
--metrics` glob that matches nothing (it would draw or list other metrics), are each one located
sentence and exit 3, never an exit 0 that looks like success."""

import orjson
import pytest

from rlctl.config import RunConfig
from rlctl.metrics import dumps_row
from rlctl.storage import Storage

from helpers import invoke

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("finished_run",)

RULE = "rules:\n  - name: r\n"
WARN = "    actions: [{type: warn}]\n"


NOT_FINITE = ["when nan", "when -inf", "Infinity on the left", "NaN in arithmetic", "1 / 0", "expr inf"]
NOT_FINITE += ["threshold value .nan", "spike sigma .inf", "spike factor .inf"]


@pytest.mark.parametrize(
    "body, key, said",
    [
        ('    when: "actor/ppo_kl > nan"\n', "'rules.0.when' (p.yaml line 3): at column 16", "'nan' is not a metric"),
        ('    when: "actor/ppo_kl > -inf"\n', "'rules.0.when' (p.yaml line 3): at column 17", "'inf' is not a metric"),
        ('    when: "Infinity < actor/ppo_kl"\n', "'rules.0.when' (p.yaml line 3): at column 1", "'Infinity' is not"),
        ('    when: "actor/ppo_kl / NaN > 1"\n', "'rules.0.when' (p.yaml line 3): at column 16", "'NaN' is not"),
        ('    when: "actor/ppo_kl > 1 / 0"\n', "'rules.0.when' (p.yaml line 3): at column 16", "'1 / 0' comes to inf"),
        (
            '    trigger: {kind: expression, expr: "actor/ppo_kl > max(actor/entropy, inf)"}\n',
            "'rules.0.trigger.expr' (p.yaml line 3): at column 35",
            "'inf' is not a metric",
        ),
        (
            '    trigger: {kind: threshold, metric: actor/ppo_kl, op: ">", value: .nan}\n',
            "'rules.0.trigger.value' (p.yaml line 3)",
            "input should be a finite number (got nan)",
        ),
        (
            "    trigger: {kind: spike, metric: actor/grad_norm, sigma: .inf}\n",
            "'rules.0.trigger.sigma' (p.yaml line 3)",
            "input should be a finite number (got inf)",
        ),
        (
            "    trigger: {kind: spike, metric: actor/grad_norm, factor: .inf}\n",
            "'rules.0.trigger.factor' (p.yaml line 3)",
            "input should be a finite number (got inf)",
        ),
    ],
    ids=NOT_FINITE,
)
def test_a_limit_that_is_not_finite_is_a_located_error(tmp_path, body, key, said):
    path = tmp_path / "p.yaml"
    path.write_text(RULE + body + WARN)
    result = invoke("policy", "check", str(path))
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)
    assert result.stdout == ""
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"Error: invalid policy file {path}: {key}"), result.stderr
    assert said in first and "warning" not in result.stderr, result.stderr


def test_finite_limits_and_names_that_merely_contain_nan_or_inf_still_pass(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text(
        RULE
        + '    when: "actor/ppo_kl > 1 / 2 and actor/entropy > -1e308 * 1.5"\n'
        + WARN
        # a rule reading names such as 'info' and 'nanny' is only a warning (no rlctl run writes them)
        + '  - name: names\n    when: "info > 0 or nanny < 0"\n'
        + WARN
    )
    result = invoke("policy", "check", str(path))
    assert result.returncode == 0, result.stderr
    assert "valid, 2 rules" in result.stdout


# -- inspect --metrics: a glob that matches nothing ----------------------------------------------------


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A run directory as rlctl writes one (4 steps, completed), written by hand: nothing trains."""
    url = str(tmp_path_factory.mktemp("silent") / "run")
    run = Storage(url)
    run.write_bytes("config.yaml", RunConfig.model_validate({"trainer": {"total_steps": 4}}).to_yaml().encode())
    rows = [
        {"step": i, "critic/score/mean": i / 10, "actor/ppo_kl": 0.01 * i, "actor/grad_norm": 1.0} for i in (1, 2, 3, 4)
    ]
    run.write_bytes("metrics.jsonl", b"".join(dumps_row(r) for r in rows))
    events = [{"event": "start"}, {"event": "completed", "step": 4}]
    run.write_bytes("events.jsonl", b"".join(orjson.dumps(e) + b"\n" for e in events))
    return url


@pytest.mark.parametrize(
    "args, said",
    [
        (["--metrics", "nope/*", "--plot", "{png}"], "--metrics 'nope/*' matches no metric of {run}"),
        (["--metrics", "actor/*, nope/*", "--format", "csv"], "--metrics 'nope/*' matches no metric of {run}"),
        (
            ["--metrics", "actor/ppo_k", "--last", "2"],
            "--metrics 'actor/ppo_k' matches no metric of {run}; did you mean 'actor/ppo_kl'?",
        ),
    ],
    ids=["plot", "csv", "did you mean"],
)
def test_a_metrics_glob_that_matches_nothing_is_exit_3_naming_it(finished_run, tmp_path, args, said):
    png = tmp_path / "p.png"
    result = invoke("inspect", finished_run, *[a.format(png=png) for a in args])
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)
    assert result.stderr == f"Error: {said.format(run=finished_run)}\n"
    assert result.stdout == "" and not png.exists()


def test_globs_that_match_still_answer(finished_run, tmp_path):
    result = invoke("inspect", finished_run, "--metrics", "actor/*", "--last", "1", "--format", "csv")
    assert (result.returncode, result.stdout) == (0, "step,actor/ppo_kl,actor/grad_norm\n4,0.04,1\n"), result.stderr
    png = tmp_path / "p.png"
    result = invoke("inspect", finished_run, "--metrics", "critic/*", "--plot", str(png))
    assert result.returncode == 0 and png.stat().st_size > 0, result.stderr
    assert result.stderr == "drew critic/score/mean\n"


def test_the_option_help_names_the_read_timeout():
    for verb in ("inspect", "checkpoints", "runs"):
        text = " ".join(invoke(verb, "--help").stdout.split())  # (as one line, however click wraps it)
        assert "--timeout SECONDS Give up on storage" in text and "default: 10.0" in text, (verb, text)
