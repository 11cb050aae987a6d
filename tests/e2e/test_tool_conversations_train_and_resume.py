"""Multi-turn tool rollouts through the real CLI: a model that does call its tool, a real tool module
run in worker processes, and ``rlctl start`` training on the conversations; then a SIGKILL mid-run and
``rlctl resume`` ending bit for bit where the uninterrupted run ends.

A random tiny model never writes a tool call, so the module's fixture teaches one to: the tiny model
over the real BPE chat tokenizer of ``chat_tokenizer`` (a ChatML template with Hermes tools), trained
for a few seconds of supervised next-token steps on four call-and-answer conversations rendered by that
template, until it writes ``<tool_call>{"name": "lookup", ...}</tool_call>`` from a prompt. Nothing is
mocked: the rollout samples that model, parses its calls, runs the tool and appends its answers as the
template's tokens."""

import json
import math
import signal
import textwrap
import time
from pathlib import Path

import pytest

from rlctl.errors import ExitCode

from chat_tokenizer import tool_model_dir
from helpers import (
    assert_steps_run_again_alike,
    completed_hash,
    events_of,
    has_step,
    invoke,
    metrics_of,
    run_cli,
    spawn,
    stable,
    start_args,
    wait_for,
)
from ray_nodes import ENV as RAY_ENV
from ray_nodes import RayNodes

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("off_reference", "reference", "task")

CAPITALS = {"france": "paris", "peru": "lima", "italy": "rome", "japan": "tokyo"}
TOOL = '''
import os
import time
from pathlib import Path

CAPITALS = {capitals!r}


def lookup(country: str) -> str:
    """The capital of a country.

    Args:
        country: The country, in lower case.
    """
    return CAPITALS.get(country.strip().lower(), "unknown") + counted()


def counted() -> str:
    """A different answer at every call, as a clock or a live service gives: " #N" for the run's N-th call
    (a counter file), taken when the call returns; the call numbered CAPITALS_HOLD_AT hangs instead, until
    the test removes COUNTER.holding (at most 300 s)."""
    path = os.environ.get("CAPITALS_COUNTER")
    if not path:
        return ""
    counter = Path(path)
    n = int(counter.read_text()) if counter.exists() else 0
    if str(n) == os.environ.get("CAPITALS_HOLD_AT"):
        holding = Path(path + ".holding")
        holding.write_text("")
        deadline = time.monotonic() + 300
        while holding.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    counter.write_text(str(n + 1))
    return f" #{{n}}"
'''
REWARD = """
def score(prompts, completions, answer, conversation, tool_calls, **kw):
    # the whole conversations and their calls come too: each ends with the model's last turn
    assert len(conversation) == len(tool_calls) == len(completions), (len(conversation), len(completions))
    assert all(m[-1]["role"] == "assistant" and m[-1]["content"].startswith(c.rstrip()) for m, c in zip(conversation, completions))
    return [1.0 if a in c else 0.0 for c, a in zip(completions, answer)]
"""
STEPS, EVERY, KILL_AT = 4, 2, 4


def call(country: str) -> str:
    return '<tool_call>{"name": "lookup", "arguments": {"country": "' + country + '"}}</tool_call>'


def teach_the_call(model_dir, tool) -> None:
    """Supervised next-token steps on the model's turns of four conversations (a call, then the answer
    after the tool's), as the chat template renders them with the tool's schema; saved in place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlctl.tools.schema import function_schema

    tok, model = AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir)
    schemas = [function_schema(tool, "lookup")]
    rows = []
    for country, capital in CAPITALS.items():
        user = [{"role": "user", "content": f"what is the capital of {country}?"}]
        turns = [
            {"role": "assistant", "content": call(country)},
            {"role": "tool", "name": "lookup", "content": capital},
            {"role": "assistant", "content": capital},
        ]
        prompt = tok.apply_chat_template(user, tools=schemas, tokenize=False, add_generation_prompt=True)
        whole = tok.apply_chat_template(user + turns, tools=schemas, tokenize=False)
        rows.append((len(tok(prompt, add_special_tokens=False)["input_ids"]), tok(whole, add_special_tokens=False)))
    width = max(len(enc["input_ids"]) for _, enc in rows)
    ids = torch.full((len(rows), width), tok.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (p, enc) in enumerate(rows):  # right-padded; the loss on what follows each prompt
        n = len(enc["input_ids"])
        ids[i, :n], attention[i, :n] = torch.tensor(enc["input_ids"]), 1
        labels[i, p:n] = ids[i, p:n]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert loss.item() < 0.05, f"the tiny model did not learn the call (loss {loss.item():.3f})"
    model.save_pretrained(model_dir)


def write_task(root: Path, module: str, source: str):
    """Into ``root``: the tool module ``module`` (``source``), the capitals' reward module and prompts;
    the tool module, imported here (the model is taught to call it)."""
    import importlib.util

    (root / f"{module}.py").write_text(source)
    (root / "capital_reward.py").write_text(textwrap.dedent(REWARD))
    prompts = [{"prompt": f"what is the capital of {c}?", "answer": a} for c, a in CAPITALS.items()]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    spec = importlib.util.spec_from_file_location(module, root / f"{module}.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    """A folder holding the tool and reward modules, the prompts, a model that calls the tool, and the
    config of a run (snapshots every EVERY steps)."""
    root = tmp_path_factory.mktemp("multi-turn")
    tool = write_task(root, "capitals", TOOL.format(capitals=CAPITALS))
    teach_the_call(tool_model_dir(root / "model"), tool.lookup)
    config = {
        "model": {"path": str(root / "model")},
        "data": {"path": str(root / "prompts.jsonl"), "apply_chat_template": True, "max_prompt_length": 256},
        "reward": {"function": "capital_reward:score"},
        "trainer": {"prompts_per_step": 2, "total_steps": STEPS},
        "algorithm": {"group_size": 2},
        "rollout": {  # min_p: no stray byte-level token (half a UTF-8 character), which does drift when re-rendered
            "max_new_tokens": 48,
            "min_p": 0.1,
            "multi_turn": {
                "tools": [{"function": "capitals:lookup"}],
                "max_turns": 2,
                "max_total_tokens": 96,
                "tool_workers": 1,
            },
        },
        "checkpoint": {"every": EVERY, "writer": "thread"},
    }
    (root / "run.yaml").write_text(json.dumps(config))
    return root


def env_of(task, run, **extra) -> dict[str, str]:
    """The tool's counter file of ``run``. (The tool and reward modules are found in the working directory,
    ``task``, by the trainer and the tool workers.)"""
    return {"CAPITALS_COUNTER": str(run) + ".counter", **extra}


@pytest.fixture(scope="module")
def reference(task):
    """The uninterrupted run; its tool answers are numbered by the run's calls."""
    run = task / "reference"
    r = run_cli("start", *start_args(run, config=task / "run.yaml"), env=env_of(task, run), cwd=task)
    assert r.returncode == 0, r.stderr
    return run


def test_the_model_calls_the_tool_and_trains_on_the_conversations(reference):
    rows = metrics_of(reference)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    for row in rows:
        assert {key for key in row if key.startswith(("multi_turn/", "tool/"))} == {
            "multi_turn/num_turns/mean",
            "multi_turn/num_turns/max",
            "multi_turn/max_turns_reached_frac",
            "multi_turn/env_token_frac",
            "multi_turn/template_drift_frac",
            "multi_turn/infra_masked_frac",
            "tool/calls/mean",
            "tool/error_frac",
            "tool/invalid_call_frac",
            "tool/timeout_frac",
            "tool/unavailable_frac",
            "tool/lookup/calls",
        }
        assert row["multi_turn/template_drift_frac"] == 0.0 and row["multi_turn/infra_masked_frac"] == 0.0
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert row["timing_s/tools"] >= 0
    assert sum(row["tool/calls/mean"] for row in rows) > 0 and sum(row["tool/lookup/calls"] for row in rows) > 0
    assert max(row["multi_turn/num_turns/max"] for row in rows) == 2  # a call, its answer, a second turn
    assert all(0 < row["multi_turn/env_token_frac"] < 1 for row in rows if row["tool/lookup/calls"])
    # the tool's answers reached the model: conversations that asked it score (the reward reads the last turn)
    assert max(row["critic/score/mean"] for row in rows) > 0
    assert not [e for e in events_of(reference) if e["event"] == "template_drift"]
    shown = invoke("inspect", str(reference)).stdout  # the summary shows the tools' key metrics and trends
    assert all(key in shown for key in ("tool/calls/mean", "tool/error_frac", "multi_turn/infra_masked_frac"))


def test_trajectories_show_a_steps_conversations_their_calls_and_trained_tokens(reference):
    """`rlctl trajectories` reads the conversations the run wrote: as many as the step trained on, their
    scores averaging to the step's critic/score/mean, their tool calls as the metrics count them, the
    model's tokens trained and the tools' and template's not; text for a person, json for a script."""
    rows = metrics_of(reference)
    step = next(r["step"] for r in rows if r["tool/lookup/calls"] > 0)
    r = invoke("trajectories", str(reference), "--step", str(step), "--format", "json")
    assert r.returncode == 0, r.stderr
    convs = json.loads(r.stdout)
    assert len(convs) == 4 and [c["step"] for c in convs] == [step] * 4  # 2 prompts x 2 samples
    assert sum(c["score"] for c in convs) / 4 == pytest.approx(rows[step - 1]["critic/score/mean"])
    calls = [call for c in convs for call in c["calls"] if call["outcome"] != "invalid"]
    assert len(calls) == rows[step - 1]["tool/lookup/calls"] and all(c["outcome"] == "ok" for c in calls)
    for c in convs:
        assert {s["by"] for s in c["segments"]} <= {"model", "tools"}
        assert all(s["trained"] == (s["by"] == "model") for s in c["segments"])  # nothing masked here
        assert sum(s["tokens"] for s in c["segments"] if s["by"] == "model") <= 48  # rollout.max_new_tokens
    called = next(c for c in convs if c["calls"])
    assert called["calls"][0]["answer"] in "".join(s["text"] for s in called["segments"] if s["by"] == "tools")
    text = invoke("trajectories", str(reference), "--step", str(step), "--index", "0")
    assert text.returncode == 0 and text.stdout.startswith(f"== step {step} · prompt ")
    assert "[model, trained, " in text.stdout and text.stdout.count("== step") == 1
    missing = invoke("trajectories", str(reference), "--step", "99")
    assert missing.returncode == 2 and f"steps 1-{STEPS} have" in missing.stderr
    assert invoke("trajectories", str(reference), "--step", "1", "--index", "4").returncode == 2


def test_sigkill_during_a_tool_call_and_resume_is_bit_exact_with_a_tool_that_never_answers_twice_alike(task, reference):
    """The tool's answers are numbered by the run's calls. SIGKILL while a call of step KILL_AT hangs (after
    the snapshot of step EVERY), and resume: the steps run again get the answers recorded the first time
    (RUN/tools), the call that never returned runs again and gets the number the uninterrupted run gave
    it, and the run ends with the same weights and the same metric rows, tool calls included. (Asking
    the tool again would have numbered every call of the steps run again differently.)"""
    calls = [int(row["tool/lookup/calls"]) for row in metrics_of(reference)]
    assert calls[KILL_AT - 1] >= 1
    hold_at = sum(calls[: KILL_AT - 1]) + min(1, calls[KILL_AT - 1] - 1)  # step KILL_AT's second call, if any
    run = task / "killed"
    env = env_of(task, run)
    proc = spawn(
        "start", str(task / "run.yaml"), "--run-dir", str(run), env={**env, "CAPITALS_HOLD_AT": str(hold_at)}, cwd=task
    )
    snapshot = run / "checkpoints" / f"step-{EVERY:06d}" / "manifest.json"  # committed: the resume's start
    holding = Path(env["CAPITALS_COUNTER"] + ".holding")
    wait_for(lambda: holding.exists() and snapshot.exists(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert has_step(run, KILL_AT - 1)() and not has_step(run, KILL_AT)()
    r = run_cli("resume", str(run), "--from", "latest", env=env, cwd=task)
    assert r.returncode == 0, r.stderr
    assert f"continuing from step {EVERY}" in r.stderr
    replayed = {e["step"]: e["calls"] for e in events_of(run) if e["event"] == "tool_calls_replayed"}
    answered = hold_at - sum(calls[: KILL_AT - 1])  # the calls of the killed step that returned
    assert replayed == {s: calls[s - 1] for s in range(EVERY + 1, KILL_AT)} | ({KILL_AT: answered} if answered else {})
    assert completed_hash(run) == completed_hash(reference)
    assert stable(metrics_of(run)) == stable(metrics_of(reference))
    assert int(Path(env["CAPITALS_COUNTER"]).read_text()) == sum(calls)  # every call asked once, none twice


def test_a_tool_outage_rolls_back_under_agentic_then_ends_the_run_with_exit_75_and_resume_completes_it(task, reference):
    """``tool_outage@3=2`` takes the tools down for two step runs from the first run of step 3, under the
    agentic policy and tool_retry_budget 1. Step 3 is masked whole (every call unavailable): tool-outage
    rolls back to step 2; step 3 runs again into the outage and rolls back again; that second step in a
    row with every call down exceeds the budget, so the run stops as a preemption does, exit 75, a
    tools_unavailable event saying why. The resume asks the tools again (the drill fired: the outage is
    over) and completes steps 3 and 4, ending where the run without an outage ends: the masked steps
    were undone, and no call of theirs reached the tool (its answers are numbered as in that run)."""
    config = json.loads((task / "run.yaml").read_text())
    config["policies"] = ["agentic"]
    config["faults"] = "tool_outage@3=2"
    config["rollout"]["multi_turn"]["tool_retry_budget"] = 1
    run = task / "outage"
    env = env_of(task, run)
    r = run_cli("start", *start_args(run, config=config), env=env, cwd=task)
    assert r.returncode == 75, r.stderr
    assert "stopped by tools_unavailable after step 2" in r.stderr
    assert "more than rollout.multi_turn.tool_retry_budget (1)" in r.stderr
    events = events_of(run)
    rollbacks = [e for e in events if e["event"] == "rollback"]
    assert [(e["rule"], e["from_step"], e["to_step"]) for e in rollbacks] == [("tool-outage", 3, EVERY)] * 2
    stopped = [(e["step"], e["steps"], e["budget"]) for e in events if e["event"] == "tools_unavailable"]
    assert stopped == [(3, 2, 1)]  # step 3's second run, the second step in a row, over a budget of 1
    preempted = [e for e in events if e["event"] == "preempted"]
    assert [(e["signal"], e["step"], e["snapshot"]) for e in preempted] == [("tools_unavailable", EVERY, EVERY)]
    assert [e["drill"] for e in events if e["event"] == "drill_fired"] == ["tool_outage@3=2"]
    masked = metrics_of(run, "metrics.abandoned.jsonl")
    assert [row["step"] for row in masked] == [3, 3]
    for row in masked:  # every call unavailable, every conversation that called masked
        assert row["tool/unavailable_frac"] == 1.0 and row["multi_turn/infra_masked_frac"] > 0.5
        assert math.isfinite(row["actor/pg_loss"])
    assert [row["step"] for row in metrics_of(run)] == [1, EVERY]

    r = run_cli("resume", str(run), "--from", "latest", env=env, cwd=task)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(row["tool/unavailable_frac"] == 0.0 and row["multi_turn/infra_masked_frac"] == 0.0 for row in rows)
    assert sum(row["tool/lookup/calls"] for row in rows[EVERY:]) > 0  # the tools answered again
    assert events_of(run)[-1]["event"] == "completed"
    assert completed_hash(run) == completed_hash(reference)
    assert stable(rows) == stable(metrics_of(reference))


def test_two_ranks_run_their_shares_of_the_conversations_with_their_own_tool_workers(task, reference):
    """Two ranks as actors of a Ray node started elsewhere (`ray start`, from another directory and without
    the tool's variable): each generates its share of the step's conversations, runs its calls in its own
    tool workers and records them and its trajectories under its rank; step 1 makes the 1-rank run's calls
    (the same weights and seeds sample the same first turns; only a first turn's calls run, max_turns=2).
    The actors start in the driver's working directory (the prompts are named relative to it) and their
    tool workers get the tool's variable (cluster.env_vars): its counter counts every call. (Local ranks
    with tools: the outage test below.)"""
    run = task / "two-ranks"
    env = {**env_of(task, run), **RAY_ENV}
    nodes = RayNodes(1, cpus=2)
    try:
        ray = ["--ray-address", nodes.address, "--set", "trainer.n_devices_per_node=2"]
        ray += ["--set", "cluster.env_vars=[CAPITALS_*]", "--set", "data.path=prompts.jsonl"]
        r = run_cli("start", *start_args(run, config=task / "run.yaml"), *ray, env=env, cwd=task)
    finally:
        nodes.stop()
    assert r.returncode == 0, r.stderr
    rows, ref = metrics_of(run), metrics_of(reference)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert rows[0]["tool/lookup/calls"] == ref[0]["tool/lookup/calls"] > 0
    assert rows[0]["tool/calls/mean"] == ref[0]["tool/calls/mean"]
    recorded = [line for f in (run / "tools").glob("step-*.rank-*.jsonl") for line in f.read_text().splitlines()]
    assert len(recorded) == sum(row["tool/lookup/calls"] for row in rows)  # every call recorded once, by its rank
    # the tool read its variable on the ranks (the two ranks' workers race on the file: at most one a call)
    assert 0 < int(Path(env["CAPITALS_COUNTER"]).read_text()) <= len(recorded)
    convs = json.loads(invoke("trajectories", str(run), "--step", "1", "--format", "json").stdout)
    assert sorted(c["rank"] for c in convs) == [0, 0, 1, 1]
    assert {p.name.split(".")[1] for p in (run / "tools").glob("step-*.jsonl")} == {"rank-0", "rank-1"}


GUESS = '''
import os


class Guess:
    """Guess the secret (the row's env_args); every turn earns a little for its length, a right guess 1."""

    def reset(self, secret: str) -> None:
        self.secret = secret

    def step(self, action: str):
        right = self.secret in action
        return ("right" if right else "no, another guess"), (1.0 if right else len(action) % 3 / 4), right

    def close(self) -> None:
        with open(os.environ["GUESS_CLOSED"], "a") as f:
            f.write("closed\\n")
'''


def test_an_environment_answers_the_turns_and_its_rewards_are_the_scores(task, tmp_path):
    """An environment instead of tools, and no reward function: each turn's reward is the environment's,
    the scores are their sums, each conversation's object is closed when its rollout ends, and the
    conversations show the steps (found in the working directory, in the trainer and the tool workers)."""
    (tmp_path / "guess.py").write_text(GUESS)
    rows = [{"prompt": f"what is the capital of {c}?", "env_args": {"secret": a}} for c, a in CAPITALS.items()]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = json.loads((task / "run.yaml").read_text())
    del config["reward"]
    config["data"]["path"] = str(tmp_path / "prompts.jsonl")
    config["rollout"]["multi_turn"] = {"environment": "guess:Guess", "max_turns": 2, "max_total_tokens": 96}
    config["trainer"]["total_steps"], config["checkpoint"]["every"] = 2, 0
    run = tmp_path / "run"
    r = run_cli("start", *start_args(run, config=config), cwd=tmp_path, env={"GUESS_CLOSED": str(tmp_path / "closed")})
    assert r.returncode == 0, r.stderr
    assert "rlctl.engine.reward.builtin:no_reward" in (run / "config.yaml").read_text()
    for row in metrics_of(run):
        assert row["critic/score/mean"] == pytest.approx(row["multi_turn/turn_reward/mean"], abs=1e-6)
        assert row["tool/calls/mean"] >= 1 and row["multi_turn/infra_masked_frac"] == 0.0
        assert math.isfinite(row["actor/pg_loss"]) and "tool/lookup/calls" not in row
    assert (tmp_path / "closed").read_text().count("closed") == 2 * 2 * 2  # steps x prompts x samples
    shown = run_cli("trajectories", str(run), "--step", "1", "--format", "json", cwd=tmp_path)
    first = json.loads(shown.stdout)[0]["calls"][0]  # a list of conversations
    assert first["name"] == "environment" and first["outcome"] == "ok" and "reward" in first


OFF = ["--set", "rollout.mode=one_step_off"]


@pytest.fixture(scope="module")
def off_reference(task):
    """The uninterrupted run in rollout.mode one_step_off."""
    ref = task / "off-ref"
    r = run_cli("start", *start_args(ref, config=task / "run.yaml"), *OFF, env=env_of(task, ref), cwd=task)
    assert r.returncode == 0, r.stderr
    assert [row["rollout/staleness/mean"] for row in metrics_of(ref)] == [0.0] + [1.0] * (STEPS - 1)
    return ref


def test_one_step_off_with_tools_resumes_bit_exactly_after_a_sigkill(task, off_reference):
    """rollout.mode one_step_off with tools that never answer twice alike: the next step's conversations
    run in the background (their calls recorded as they end) while a step trains. Killed after step 3 (the
    last snapshot: step 2, holding step 3's batch), resumed: the same weights and metric rows as the
    uninterrupted run, the background step's calls replayed from the record, every call asked once."""
    off, ref = OFF, off_reference
    run = task / "off-killed"
    env = env_of(task, run)
    proc = spawn("start", str(task / "run.yaml"), "--run-dir", str(run), *off, env=env, cwd=task, faults="sleep@3=120")
    snapshot = run / "checkpoints" / f"step-{EVERY:06d}" / "manifest.json"
    calls4 = int(metrics_of(ref)[3]["tool/lookup/calls"])
    assert calls4 >= 1
    step4 = run / "tools" / "step-000004.rank-0.jsonl"  # step 4's calls, made in the background meanwhile

    def step4_recorded() -> bool:
        # every call of step 4 on record (whole lines): a kill between a call's answer and its line would
        # ask that call again on resume, and this tool answers every call differently
        return step4.exists() and step4.read_bytes().count(b"\n") >= calls4

    wait_for(lambda: has_step(run, 3)() and snapshot.exists() and step4_recorded(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run_cli("resume", str(run), "--from", "latest", env=env, cwd=task)
    assert r.returncode == 0, r.stderr
    assert completed_hash(run) == completed_hash(ref)
    assert stable(metrics_of(run)) == stable(metrics_of(ref)), _what_differs(run, ref)
    asked = sum(int(row["tool/lookup/calls"]) for row in metrics_of(ref))
    assert int(Path(env["CAPITALS_COUNTER"]).read_text()) == asked  # every call asked once, none twice


def test_sigterm_while_a_batch_generated_ahead_waits_on_a_tool_call_is_75_and_resumes_exactly(task, off_reference):
    """SIGTERM while step 3's batch, generated in the background during step 2, waits on a tool call that
    hangs: the run stops at the next step's end, waits for the batch in flight (the call returns once the
    test lets it), commits a snapshot holding it and exits 75; the resume ends as the uninterrupted run,
    every call asked once."""
    calls = [int(row["tool/lookup/calls"]) for row in metrics_of(off_reference)]
    assert calls[2] >= 1
    run = task / "off-stopped"
    env = env_of(task, run)
    hold = {**env, "CAPITALS_HOLD_AT": str(sum(calls[:2]))}  # step 3's first call (numbered from 0)
    proc = spawn("start", str(task / "run.yaml"), "--run-dir", str(run), *OFF, env=hold, cwd=task)
    holding = Path(env["CAPITALS_COUNTER"] + ".holding")
    wait_for(holding.exists, proc)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    holding.unlink()  # the call returns: the batch in flight completes
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == ExitCode.PREEMPTED, err
    assert [e["event"] for e in events_of(run)][-2:] == ["snapshot_committed", "preempted"], err
    r = run_cli("resume", str(run), "--from", "latest", env=env, cwd=task)
    assert r.returncode == 0, r.stderr
    assert completed_hash(run) == completed_hash(off_reference)
    assert stable(metrics_of(run)) == stable(metrics_of(off_reference)), _what_differs(run, off_reference)
    assert int(Path(env["CAPITALS_COUNTER"]).read_text()) == sum(calls)  # every call asked once, none twice


def test_tools_on_the_vllm_backend_one_step_off_resume_exactly(task):
    """The whole CLI on the vllm backend with tools, generating a step ahead: each turn sampled by the
    rank's engine (which the trainer's rollout and the one ahead share), the tool's answers appended.
    Resumed from snapshot 2 (holding step 3's batch; step 4's calls replayed from the record, as this tool
    answers every call differently), steps 3 and 4 and the final weights come out bit for bit."""
    pytest.importorskip("vllm")
    run = task / "vllm-off"
    args = ["--set", "rollout.backend=vllm", *OFF]
    r = run_cli("start", *start_args(run, config=task / "run.yaml"), *args, env=env_of(task, run), cwd=task)
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["rollout/staleness/mean"] for row in rows] == [0.0] + [1.0] * (STEPS - 1)
    assert sum(row["tool/lookup/calls"] for row in rows) > 0 and max(r["multi_turn/num_turns/max"] for r in rows) == 2
    r = run_cli("resume", str(run), "--from", f"step-{EVERY:06d}", env=env_of(task, run), cwd=task)
    assert r.returncode == 0, r.stderr
    assert_steps_run_again_alike(run, [3, 4])
    assert events_of(run, "tool_calls_replayed")  # step 4's calls, made before the resume


def _what_differs(run, ref) -> str:
    """Where two runs' metric rows differ: each differing key's values, and the conversations the first
    such step trained in each (their text, scores and calls), to tell apart a tool's answer, a sampled
    token and a forward's rounding."""
    lines, first = [], None
    for mine, theirs in zip(stable(metrics_of(run)), stable(metrics_of(ref))):
        keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if keys:
            first = first or mine["step"]
            lines += [f"step {mine['step']} {k}: {mine.get(k)!r} != {theirs.get(k)!r}" for k in keys]
    for name, where in (("resumed", run), ("reference", ref)):
        if first is not None:
            shown = invoke("trajectories", str(where), "--step", str(first), "--format", "json").stdout
            lines.append(f"{name} step {first}: {shown[:3000]}")
    return "\n".join(lines)


TURN_REWARD = """
def score(prompts, completions, answer, conversation, **kw):
    # the answer's score, and 0.5 for each turn of the model's, on that turn's last token
    return [
        {"score": float(a in c), "turns": [0.5] * sum(m["role"] == "assistant" for m in conv)}
        for c, a, conv in zip(completions, answer, conversation)
    ]
"""


def test_a_reward_functions_turn_rewards_are_part_of_each_conversations_score(task, tmp_path):
    (task / "turn_reward.py").write_text(TURN_REWARD)
    config = json.loads((task / "run.yaml").read_text())
    config["reward"] = {"function": "turn_reward:score"}
    config["trainer"]["total_steps"], config["checkpoint"]["every"] = 2, 0
    run = tmp_path / "run"
    r = run_cli("start", *start_args(run, config=config), env=env_of(task, run), cwd=task)
    assert r.returncode == 0, r.stderr
    convs = json.loads(invoke("trajectories", str(run), "--step", "2", "--format", "json").stdout)
    assert convs and all(c["score"] - 0.5 * c["turns"] in (0.0, 1.0) for c in convs)
    assert any(c["turns"] > 1 for c in convs)  # a call, then a second turn: two turn rewards


def test_on_two_ranks_a_tool_outage_past_the_budget_stops_every_rank_after_the_same_step(task):
    """tool_retry_budget 0 and the tools down from step 2 on both ranks (each rank's own workers): the
    step's reduced row says every call failed, so both ranks stop after step 2, exit 75, one
    tools_unavailable event; the resume, the outage over, completes the run."""
    config = json.loads((task / "run.yaml").read_text())
    config["faults"] = "tool_outage@2=1"
    config["rollout"]["multi_turn"]["tool_retry_budget"] = 0
    run = task / "two-ranks-outage"
    env = env_of(task, run)
    r = run_cli("start", *start_args(run, config=config), "--nproc", "2", env=env, cwd=task)
    assert r.returncode == 75, r.stderr
    assert "stopped by tools_unavailable after step 2" in r.stderr
    assert [(e["step"], e["steps"]) for e in events_of(run, "tools_unavailable")] == [(2, 1)]
    assert metrics_of(run)[-1]["tool/unavailable_frac"] == 1.0
    r = run_cli("resume", str(run), "--from", "latest", env=env, cwd=task)
    assert r.returncode == 0, r.stderr
    assert [row["step"] for row in metrics_of(run)] == list(range(1, STEPS + 1))
