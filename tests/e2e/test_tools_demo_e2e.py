"""`rlctl start tools-demo` for a few steps: the built-in model from random weights samples the call token
its chat tokenizer holds, the hermes parser reads it, the `lookup` tool runs in a worker process and its
answer, the row's hidden word, is appended through the chat template; a conversation scores only where
that answer reached the model. (That the demo learns is measured in docs/multi-turn.md, not here.)"""

import json

from transformers import AutoTokenizer

from helpers import REPO, invoke, metrics_of, start_args

CALL = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
STEPS = 3


def test_the_tools_demo_makes_real_calls_that_are_answered_and_scores_only_looked_up_words(tmp_path):
    run = tmp_path / "tools-demo"
    r = invoke(
        "start", *start_args(run, config="tools-demo", steps=STEPS), "--set", "trainer.prompts_per_step=4", cwd=REPO
    )
    assert r.returncode == 0, r.stderr
    rows = metrics_of(run)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert sum(row["tool/lookup/calls"] for row in rows) > 0
    for row in rows:
        assert row["multi_turn/template_drift_frac"] == 0.0 and row["tool/invalid_call_frac"] == 0.0
        assert row["multi_turn/infra_masked_frac"] == 0.0 and row["tool/error_frac"] == 0.0
    tok = AutoTokenizer.from_pretrained(run / "model")  # the whole call is one token of the built-in tokenizer
    assert len(tok(CALL, add_special_tokens=False)["input_ids"]) == 1
    convs = [c for s in range(1, STEPS + 1) for c in json.loads(trajectories(run, s))]
    called = [c for c in convs if c["calls"]]
    assert called and len(convs) == STEPS * 4 * 8
    for c in called:
        call = c["calls"][0]
        word = call["arguments"]["word"]  # the row's hidden argument, never in the prompt
        assert call["outcome"] == "ok" and call["answer"] == word and word not in c["prompt"]
        model = [s["text"] for s in c["segments"] if s["by"] == "model"]
        tools = "".join(s["text"] for s in c["segments"] if s["by"] == "tools")
        assert model[0].endswith(CALL) and f"<tool_response>\n{word}\n</tool_response>" in tools
    assert all(c["score"] == 0 for c in convs if not c["calls"])  # no look-up, no score


def trajectories(run, step) -> str:
    r = invoke("trajectories", str(run), "--step", str(step), "--format", "json")
    assert r.returncode == 0, r.stderr
    return r.stdout
