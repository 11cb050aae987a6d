"""The python tool in a real multi-turn run, SIGKILLed mid-run and resumed bit for bit.

The tool is a stateful session on the built-in ``rlctl.tools.python:Python`` (the model's tiny
vocabulary cannot write Python, so the tool writes the code the model's call stands for): each call
runs, in the jail, a cell that counts the conversation's calls in a variable kept between its turns and
prints the country and that count (the earlier cells run again first). The model is taught to call it as
in ``test_tool_conversations_train_and_resume``. A run SIGKILLed after its first snapshot and resumed ends with the same
weights and metric rows as an uninterrupted one: the steps run again got the recorded answers."""

import json
import signal

import pytest
from test_tool_conversations_train_and_resume import teach_the_call, write_task

from rlctl.sandbox import Limits, SandboxUnavailable, check

from chat_tokenizer import tool_model_dir
from helpers import completed_hash, events_of, metrics_of, run_cli, spawn, stable, start_args, wait_for

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("task",)

try:
    check(Limits(), "sandbox")
    problem = None
except SandboxUnavailable as exc:
    problem = str(exc)
pytestmark = pytest.mark.skipif(problem is not None, reason=f"no bubblewrap jail on this machine: {problem}")

TOOL = '''
from rlctl.tools.python import Python


class Lookup(Python):
    def call(self, country: str) -> str:
        """The capital of a country.

        Args:
            country: The country, in lower case.
        """
        code = "n = globals().get('n', 0) + 1\\nprint(%r, n)" % country.strip().lower()
        return super().call(code)
'''
STEPS, EVERY = 3, 1


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("python-tool")
    tool = write_task(root, "sessions", TOOL)
    teach_the_call(tool_model_dir(root / "model"), tool.Lookup.call)
    config = {
        "model": {"path": str(root / "model")},
        "data": {"path": str(root / "prompts.jsonl"), "apply_chat_template": True, "max_prompt_length": 256},
        "reward": {"function": "capital_reward:score"},
        "trainer": {"prompts_per_step": 2, "total_steps": STEPS},
        "algorithm": {"group_size": 2},
        "rollout": {
            "max_new_tokens": 48,
            "min_p": 0.1,
            "multi_turn": {
                "tools": [{"stateful": "sessions:Lookup", "name": "lookup"}],
                "max_turns": 2,
                "max_total_tokens": 96,
                "tool_workers": 1,
                "tool_timeout_s": 60,
                "sandbox": {"wall_time_s": 30},  # (a jail starts in seconds on a loaded machine)
            },
        },
        "checkpoint": {"every": EVERY, "writer": "thread"},
    }
    (root / "run.yaml").write_text(json.dumps(config))
    return root


def test_a_run_with_the_python_tool_killed_and_resumed_ends_bit_identical(task):
    reference = task / "reference"
    r = run_cli("start", *start_args(reference, config=task / "run.yaml"), cwd=task)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(reference)
    assert sum(row["tool/lookup/calls"] for row in rows) > 0 and all(row["tool/error_frac"] == 0 for row in rows)
    calls = sum(row["tool/lookup/calls"] for row in rows)  # the built-in tool's own metrics count the same calls
    assert sum(row["tool/python/calls"] for row in rows) == calls
    assert all(row["tool/python/errors"] == row["tool/python/timeouts"] == 0 for row in rows)
    run = task / "killed"
    proc = spawn("start", str(task / "run.yaml"), "--run-dir", str(run), cwd=task)
    snapshot = run / "checkpoints" / f"step-{STEPS - 1:06d}" / "manifest.json"
    calls = run / "tools" / f"step-{STEPS:06d}.rank-0.jsonl"  # the last step's calls, some answered
    wait_for(lambda: snapshot.exists() and calls.exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run_cli("resume", str(run), "--from", "latest", cwd=task)
    assert r.returncode == 0, r.stderr
    assert any(e["event"] == "tool_calls_replayed" for e in events_of(run))
    assert completed_hash(run) == completed_hash(reference)
    assert stable(metrics_of(run)) == stable(metrics_of(reference))
