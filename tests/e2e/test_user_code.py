"""User code is untrusted input: a reward function that exits, raises or returns something other than
one finite number per completion ends the real CLI with exit 4 and one sentence naming it; a real
Ctrl-C while it runs is still an interrupt (130)."""

import re
import textwrap

from rlctl.errors import ExitCode

from helpers import SMALL, events_of, metrics_of, run_cli, start_args


def reward_module(tmp_path, name: str, body: str) -> str:
    """A reward module next to the run (the working directory), that behaves at its second call
    (step 2) as ``body`` says and scores 0.5 before."""
    source = f"""
        import os, signal
        calls = 0
        def score(prompts, completions, **kw):
            global calls
            calls += 1
            if calls == 2:
        {textwrap.indent(textwrap.dedent(body), " " * 8)}
            return [0.5] * len(completions)
        """
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    return f"{name}:score"


def start_with(tmp_path, spec: str):
    """A 3-step run of the reward ``spec``, started in ``tmp_path`` (where its module is)."""
    run = tmp_path / "run"
    return run, run_cli("start", *start_args(run, steps=3), *SMALL, "--set", f"reward.function={spec}", cwd=tmp_path)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def test_a_reward_that_calls_exit_0_at_step_2_ends_with_exit_4(tmp_path):
    spec = reward_module(tmp_path, "exits", "raise SystemExit(0)")
    run, r = start_with(tmp_path, spec)
    assert r.returncode == ExitCode.INPUT, r.stderr
    assert "Traceback" not in r.stderr
    [line] = error_lines(r.stderr)
    assert re.fullmatch(
        rf"Error: reward function 'exits:score' raised SystemExit\(0\) \({tmp_path}/exits\.py:\d+\)", line
    )
    assert [row["step"] for row in metrics_of(run)] == [1]
    crashed = [e for e in events_of(run) if e["event"] == "crashed"]
    assert len(crashed) == 1 and "SystemExit(0)" in crashed[0]["error"]
    assert not any(e["event"] == "completed" for e in events_of(run))


def test_a_reward_that_returns_strings_ends_with_exit_4(tmp_path):
    spec = reward_module(tmp_path, "strings", "return ['abc'] * len(completions)")
    run, r = start_with(tmp_path, spec)
    assert r.returncode == ExitCode.INPUT, r.stderr
    assert "Traceback" not in r.stderr
    assert error_lines(r.stderr) == [
        "Error: reward function 'strings:score' returned 'abc' for completion 0; expected one finite number per "
        "completion"
    ]


def test_a_real_ctrl_c_inside_the_reward_is_an_interrupt_not_an_input_error(tmp_path):
    spec = reward_module(tmp_path, "ctrlc", "os.kill(os.getpid(), signal.SIGINT)")
    run, r = start_with(tmp_path, spec)
    assert r.returncode == ExitCode.INTERRUPTED, r.stderr
    assert "Traceback" not in r.stderr and not error_lines(r.stderr)
    assert [e["event"] for e in events_of(run)][-1] == "interrupted"


def test_a_reward_module_that_does_not_import_stops_before_the_run_directory_exists(tmp_path):
    """Found by the checks before any work (rlctl.preflight): a retry of the fixed command with
    the same --run-dir is not refused."""
    (tmp_path / "broken.py").write_text("def score(prompts, completions:\n")
    run, r = start_with(tmp_path, "broken:score")
    assert r.returncode == ExitCode.INPUT, r.stderr
    [line] = error_lines(r.stderr)
    assert line.startswith("Error: reward function 'broken:score': importing module 'broken' raised SyntaxError")
    assert not run.exists()
