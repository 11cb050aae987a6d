"""The multi-turn rollout on the HF backend with a real tiny model over a real BPE chat tokenizer and real
tools in worker processes: a turn's calls are answered as template increments (masked), malformed calls
and exceptions go back to the model as errors, an infrastructure failure masks the conversation whole,
answers are cut in tokens, and a generated batch keeps the model's log-probs aligned with its mask."""

import pytest
import torch

from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.engine.actor import Actor
from rlctl.engine.model import load_tokenizer
from rlctl.engine.rollout.conversation import Conversation, ToolStats, batch_of
from rlctl.engine.rollout.multi_turn import MultiTurnRollout
from rlctl.engine.rollout.offers import Offer
from rlctl.engine.rollout.tool_calls import OUTAGE
from rlctl.engine.tool_workers.call_record import ToolRecord
from rlctl.engine.tool_workers.loader import load_tools
from rlctl.engine.tool_workers.pool import ToolPool
from rlctl.errors import ConfigError, InputError
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage

from chat_tokenizer import tool_model_dir, tool_run_config

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("rollout",)

TOOLS = [
    {"function": "toolbox:lookup"},
    {"function": "toolbox:fail"},
    {"function": "toolbox:down"},
    {"function": "toolbox:words"},
    {"function": "toolbox:tick"},
    {"function": "toolbox:check", "hidden": ["expected"]},
]


@pytest.fixture(scope="module")
def rollout(runtime, tmp_path_factory):
    model_dir = tool_model_dir(tmp_path_factory.mktemp("tool-model"))
    cfg = tool_run_config(model_dir, max_new_tokens=48)
    mt = MultiTurnConfig(tools=TOOLS, max_turns=3, max_total_tokens=400, max_tool_response_tokens=100, tool_timeout_s=5)
    with ToolPool(mt.tool_workers, mt.tool_timeout_s) as pool:
        yield MultiTurnRollout(cfg, Actor(cfg, model_dir, runtime), load_tokenizer(model_dir), mt, load_tools(mt), pool)


def test_a_turns_calls_are_answered_as_masked_template_tokens(rollout):
    chat, tok = rollout.chat, rollout.tokenizer
    calls = (
        '<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>',
        '<tool_call>{"name": "fail", "arguments": {"x": 1}}</tool_call>',
        '<tool_call>{"name": "lookup", "arguments": {"nation": "peru"}}</tool_call>',
        "<tool_call>not json</tool_call>",
        '<tool_call>{"name": "words", "arguments": {"n": 80}}</tool_call>',
        '<tool_call>{"name": "down", "arguments": {}}</tool_call>',
        "no call, the answer is lima",
    )
    convs = [Conversation("capital of peru?", (i, 0)) for i in range(len(calls))]
    turns = [chat.encode(c) for c in calls]
    for c, t in zip(convs, turns):
        c.ids, c.model, c.log_probs = list(t), [True] * len(t), [-1.0] * len(t)
    stats = ToolStats(by_name=dict.fromkeys(rollout.schemas, 0))
    rollout._answer(list(enumerate(convs)), turns, 1, 0, stats)
    said = [tok.decode(c.ids[len(t) :]) for c, t in zip(convs, turns)]
    assert "<tool_response>\nlima\n</tool_response>" in said[0]
    assert "error: ValueError: bad x 1 (at toolbox.py line" in said[1]
    assert "error: lookup has no argument 'nation'; its arguments are: country" in said[2]
    assert "error: the tool call is not valid JSON" in said[3]
    answer = said[4].split("<tool_response>\n")[1].split("\n</tool_response>")[0]
    assert len(chat.encode(answer)) == 100 and answer.startswith("word0 word1")  # cut to 100 tokens
    assert "error: the lookup service is down" in said[5]
    assert said[6] == "" and convs[6].done  # no call: the conversation is over
    assert all(c.model == [True] * len(t) + [False] * (len(c.ids) - len(t)) for c, t in zip(convs, turns))
    assert [c.infra_failed for c in convs] == [False] * 5 + [True, False]
    assert (stats.calls, stats.errors, stats.invalid, stats.unavailable, stats.timeouts) == (6, 1, 2, 1, 0)
    assert stats.by_name == {"lookup": 1, "fail": 1, "down": 1, "words": 1, "tick": 0, "check": 0}
    batch = batch_of(rollout.encode(["capital of peru?"] * 7), convs, rollout.tokenizer.pad_token_id)
    assert batch.response_mask[5].sum() == 0 and batch.response_mask[0].sum() == len(turns[0])  # masked whole
    assert (batch.attention_mask[:, batch.prompt_len :].sum(-1) == torch.tensor([len(c.ids) for c in convs])).all()
    assert rollout.decode(batch)[6] == "no call, the answer is lima" and rollout.decode(batch)[5] == ""


def test_generated_conversations_keep_log_probs_aligned_with_the_mask(rollout):
    seqs = rollout.generate(["capital of peru?", "capital of italy?"] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step=1)
    again = rollout.generate(["capital of peru?", "capital of italy?"] * 2, [(0, 0), (1, 0), (0, 1), (1, 1)], step=1)
    assert torch.equal(seqs.input_ids, again.input_ids)  # seeded per conversation and turn
    mask = seqs.response_mask.bool()
    assert mask.any() and (mask <= seqs.attention_mask[:, seqs.prompt_len :].bool()).all()
    lp, _ = rollout.actor.log_probs(seqs, rollout.cfg.rollout.temperature)
    assert torch.allclose(lp[mask], seqs.rollout_log_probs[mask], atol=1e-4)
    assert (seqs.rollout_log_probs[~mask] == 0).all()
    columns = rollout.reward_columns()  # what the reward function gets besides the completions
    assert set(columns) == {"conversation", "tool_calls"} and len(columns["conversation"]) == 4
    for messages, calls, completion in zip(columns["conversation"], columns["tool_calls"], rollout.decode(again)):
        assert messages[0]["role"] == "user" and messages[-1]["role"] == "assistant"
        assert messages[-1]["content"].startswith(completion.rstrip())
        assert len(calls) >= sum(m["role"] == "tool" for m in messages)  # an answer per call (room permitting)
    metrics = rollout.take_metrics()
    assert set(metrics) == set(rollout.reductions) and rollout.take_metrics() == {}
    assert metrics["multi_turn/num_turns/mean"] >= 1 and metrics["tool/lookup/calls"] >= 0


def _turn(rollout, calls: list[str], step: int) -> tuple[list[str], ToolStats]:
    """The answers the rollout appends to one turn of ``calls`` at ``step``."""
    convs = [Conversation("what time is it?", (i, 0)) for i in range(len(calls))]
    turns = [rollout.chat.encode(c) for c in calls]
    for c, t in zip(convs, turns):
        c.ids, c.model, c.log_probs = list(t), [True] * len(t), [-1.0] * len(t)
    stats = ToolStats(by_name=dict.fromkeys(rollout.schemas, 0))
    rollout._answer(list(enumerate(convs)), turns, step, 0, stats)
    return [rollout.tokenizer.decode(c.ids[len(t) :]) for c, t in zip(convs, turns)], stats


def test_a_step_run_again_replays_its_recorded_answers_and_asks_again_after_an_outage(rollout, tmp_path):
    """A tool that never answers twice alike (the clock): the same step run again, by a fresh record of the
    same run (a resumed process), gets the recorded answers, not new ones; another step asks the tool; an
    unavailable tool's failure is not recorded (asked again); a torn line and a lost answer are asked again."""
    tick = '<tool_call>{"name": "tick", "arguments": {}}</tool_call>'
    down = '<tool_call>{"name": "down", "arguments": {}}</tool_call>'
    run = Storage(str(tmp_path / "run"))
    try:
        rollout.record = ToolRecord(RunDir(run), 0)
        rollout.record.begin(3)
        first, stats = _turn(rollout, [tick, tick, down], 3)
        assert first[0] != first[1] and stats.replayed == 0
        rollout.record = ToolRecord(RunDir(run), 0)  # the resumed process
        rollout.record.begin(3)
        again, stats = _turn(rollout, [tick, tick, down], 3)
        assert again[:2] == first[:2] and stats.replayed == 2 and stats.unavailable == 1
        rollout.record.begin(4)
        assert _turn(rollout, [tick], 4)[0][0] != first[0]

        files = sorted(p.name for p in (tmp_path / "run" / "tools").iterdir())
        assert files == ["results", "step-000003.rank-0.jsonl", "step-000004.rank-0.jsonl"]
        lines = (tmp_path / "run" / "tools" / "step-000003.rank-0.jsonl").read_bytes().splitlines()
        assert len(lines) == 2  # the two clock calls, as each ended (either first); the outage is not recorded
        (tmp_path / "run" / "tools" / "step-000003.rank-0.jsonl").write_bytes(lines[0] + b"\n" + lines[1][:20])
        rollout.record = ToolRecord(RunDir(run), 0)
        rollout.record.begin(3)
        torn, stats = _turn(rollout, [tick, tick], 3)
        assert stats.replayed == 1 and sum(t == f for t, f in zip(torn, first)) == 1  # the torn line's: asked again
        for blob in (tmp_path / "run" / "tools" / "results").iterdir():
            blob.unlink()
        rollout.record = ToolRecord(RunDir(run), 0)
        rollout.record.begin(3)
        assert _turn(rollout, [tick], 3)[1].replayed == 0  # its answer lost: asked again
    finally:
        rollout.record = None


def test_under_a_tool_outage_drill_every_call_is_unavailable_and_nothing_is_asked_replayed_or_recorded(
    rollout, tmp_path
):
    """The tool_outage drill's steps: a lookup that would say lima, a recorded clock answer that would be
    replayed, all answered "unavailable", the conversations masked, the record untouched."""
    tick = '<tool_call>{"name": "tick", "arguments": {}}</tool_call>'
    lookup = '<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>'
    run = Storage(str(tmp_path / "run"))
    record = tmp_path / "run" / "tools" / "step-000005.rank-0.jsonl"
    try:
        rollout.record = ToolRecord(RunDir(run), 0)
        rollout.record.begin(5)
        _turn(rollout, [tick], 5)
        lines = record.read_bytes()
        rollout.record = ToolRecord(RunDir(run), 0)  # the step run again, now in the outage
        rollout.record.begin(5)
        rollout.calls.outage = True
        said, stats = _turn(rollout, [tick, lookup, "<tool_call>not json</tool_call>"], 5)
        assert all(OUTAGE in s for s in said[:2]) and "lima" not in said[1] and "not valid JSON" in said[2]
        assert (stats.calls, stats.unavailable, stats.invalid, stats.replayed) == (3, 2, 1, 0)
        assert record.read_bytes() == lines
    finally:
        rollout.record, rollout.calls.outage = None, None


def test_a_rows_tools_and_hidden_arguments_reach_its_prompt_and_its_calls(rollout):
    """A row offering only `check` gets only its schema in the prompt, without the hidden `expected`;
    its calls get the row's `expected`; a call to a tool it was not offered, or one filling the hidden
    parameter itself, is an error the model reads."""
    columns = {"tools": [["check"], None], "tool_args": [{"check": {"expected": "Lima"}}, None]}
    offers = rollout.offers.of(columns, [(0, 0), (1, 0)])
    assert offers[0] == Offer(("check",), {"check": {"expected": "Lima"}}) and offers[1] == Offer()
    enc = rollout.encode(["capital of peru?"] * 2, offers)
    own, every = (rollout.tokenizer.decode(ids[m.bool()]) for ids, m in zip(enc["input_ids"], enc["attention_mask"]))
    assert '"check"' in own and '"lookup"' not in own and '"expected"' not in own
    assert '"tick"' in every and '"check"' in every and '"expected"' not in every  # (cut from the left at 400)
    calls = [
        '<tool_call>{"name": "check", "arguments": {"answer": "lima"}}</tool_call>',
        '<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>',
        '<tool_call>{"name": "check", "arguments": {"answer": "lima", "expected": "lima"}}</tool_call>',
    ]
    convs = [Conversation("capital of peru?", (i, 0), offer=offers[0]) for i in range(3)]
    turns = [rollout.chat.encode(c) for c in calls]
    for c, t in zip(convs, turns):
        c.ids, c.model, c.log_probs = list(t), [True] * len(t), [-1.0] * len(t)
    stats = ToolStats(by_name=dict.fromkeys(rollout.schemas, 0))
    rollout._answer(list(enumerate(convs)), turns, 1, 0, stats)
    said = [rollout.tokenizer.decode(c.ids[len(t) :]) for c, t in zip(convs, turns)]
    assert "<tool_response>\ncorrect\n</tool_response>" in said[0]
    assert convs[0].calls[0]["arguments"] == {"answer": "lima", "expected": "Lima"}
    assert "error: there is no tool named 'lookup'; the tools are: check" in said[1]
    assert "error: check has no argument 'expected'" in said[2]


@pytest.mark.parametrize(
    ("columns", "says"),
    [
        ({"tools": [["nope"]]}, "prompt 7's 'tools' names tools the run does not declare: nope"),
        ({"tools": ["lookup"]}, "must be a list of tool names"),
        (
            {"tool_args": [{"check": {"answer": "x"}}]},
            "gives check the parameters answer, which are not among its hidden",
        ),
        ({"tool_args": [["x"]]}, "must map a tool's name"),
    ],
)
def test_a_rows_bad_tools_or_arguments_are_input_errors_naming_the_prompt(rollout, columns, says):
    with pytest.raises(InputError, match=says):
        rollout.offers.of(columns, [(7, 0)])


def test_a_hidden_parameter_the_tool_lacks_is_refused_naming_the_key():
    mt = MultiTurnConfig(tools=[{"function": "toolbox:lookup", "hidden": ["city"]}])
    with pytest.raises(ConfigError, match=r"tools\[0\]\.hidden': 'city' is not a parameter of the tool lookup"):
        load_tools(mt)
