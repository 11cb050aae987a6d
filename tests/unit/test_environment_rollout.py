"""The multi-turn rollout with an environment and with a stateful tool, on the HF backend with a real tiny
model, a real BPE chat tokenizer and real objects in the tool workers: an environment's observation is the
next user message (template tokens, masked), its reward sits on the turn's last token of the model's and
moves there from the score's end in the advantages; a stateful tool keeps its state across the turns of
one conversation, gets its row's hidden values at create(), and a step run again (its first calls
replayed from the record, its object gone) rebuilds it so the next call answers as the first run's did."""

import pytest
import torch

from rlctl.config import AlgorithmConfig
from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.engine.actor import Actor
from rlctl.engine.experience import advantages_of
from rlctl.engine.model import load_tokenizer
from rlctl.engine.rollout.conversation import Conversation, ToolStats, batch_of
from rlctl.engine.rollout.multi_turn import MultiTurnRollout
from rlctl.engine.rollout.offers import Offer
from rlctl.engine.tool_workers.call_record import ToolRecord
from rlctl.engine.tool_workers.loader import load_tools
from rlctl.engine.tool_workers.pool import ToolPool
from rlctl.errors import ConfigError
from rlctl.rundir.handle import RunDir
from rlctl.storage import Storage

from chat_tokenizer import tool_model_dir, tool_run_config

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("made",)


@pytest.fixture(scope="module")
def made(runtime, tmp_path_factory):
    """make(mt): a multi-turn rollout of the tiny chat model under ``mt`` (its pool closed at the end)."""
    model_dir = tool_model_dir(tmp_path_factory.mktemp("tool-model"))
    cfg = tool_run_config(model_dir, max_new_tokens=200)
    actor, tok, pools = Actor(cfg, model_dir, runtime), load_tokenizer(model_dir), []

    def make(**mt):
        mt = MultiTurnConfig(**{"max_turns": 3, "max_total_tokens": 400, "tool_timeout_s": 5, **mt})
        pools.append(ToolPool(mt.tool_workers, mt.tool_timeout_s))
        return MultiTurnRollout(cfg, actor, tok, mt, load_tools(mt), pools[-1])

    yield make
    for pool in pools:
        pool.close()


def _start(rollout, texts: list[str], **conv) -> tuple[list[Conversation], list[list[int]]]:
    convs = [Conversation("guess my number", (i, 0), **conv) for i in range(len(texts))]
    return convs, _said(rollout, convs, texts)


def _said(rollout, convs, texts: list[str]) -> list[list[int]]:
    """The model's turn ``texts`` appended to ``convs`` (as if sampled)."""
    turns = [rollout.chat.encode(t) for t in texts]
    for c, t in zip(convs, turns):
        c.ids, c.model, c.log_probs = c.ids + t, c.model + [True] * len(t), c.log_probs + [-1.0] * len(t)
        c.messages.append({"role": "user", "content": "guess my number"}) if not c.messages else None
    return turns


def test_an_environment_answers_each_turn_and_rewards_it_on_its_last_token(made):
    rollout = made(environment="toolbox:Guess")
    assert rollout.schemas == {}  # no tools rendered into the prompt
    convs, turns = _start(rollout, ["1", "I say 3", "five"], env_args={"secret": 3})
    stats = ToolStats()
    rollout._step_environment(list(enumerate(convs)), turns, 1, 0, stats)
    tok = rollout.tokenizer
    said = [tok.decode(c.ids[len(t) :]) for c, t in zip(convs, turns)]
    assert "<|im_start|>user\nhigher (1)<|im_end|>" in said[0] and said[0].endswith("<|im_start|>assistant\n")
    assert convs[1].done and said[1] == "" and convs[1].turn_rewards == [(len(turns[1]) - 1, 1.0)]
    assert "say a number" in said[2] and convs[2].turn_rewards == [(len(turns[2]) - 1, 0.0)]
    assert convs[0].turn_rewards == [(len(turns[0]) - 1, 0.1)] and not convs[0].done
    assert all(c.model == [True] * len(t) + [False] * (len(c.ids) - len(t)) for c, t in zip(convs, turns))
    assert stats.calls == 3 and convs[0].calls[0] == {
        "turn": 0,
        "name": "environment",
        "arguments": {"action": "1"},
        "outcome": "ok",
        "answer": "higher (1)",
        "reward": 0.1,
        "done": False,
    }
    # the second turn: the environment remembers the first guess (its object kept in the worker)
    end = len(convs[0].ids)
    second = _said(rollout, convs[:1], ["3"])
    rollout._step_environment([(0, convs[0])], second, 1, 1, stats)
    assert convs[0].calls[1]["answer"] == "right after 2" and convs[0].done
    assert convs[0].turn_rewards[1] == (end + len(second[0]) - 1, 1.0)
    rollout.calls.pool.release()

    # in the batch and the advantages: the score holds the turns' rewards; they sit at their turns' ends
    batch = batch_of(rollout.encode(["guess my number"] * 3), convs, tok.pad_token_id)
    scores = torch.tensor([0.5, 0.0, 0.0]) + batch.turn_rewards.sum(-1)  # a reward function's 0.5, and theirs
    a = AlgorithmConfig(name="grpo", group_size=3, adv_estimator="reinforce_plus_plus", gamma=0.5)
    rewards, _, _, _ = advantages_of(a, batch, scores, None, None, None, 0.0)
    assert torch.allclose(rewards.sum(-1), scores)
    last = int(batch.response_mask[0].nonzero().max())
    assert rewards[0, len(turns[0]) - 1] == pytest.approx(0.1) and rewards[0, last] == pytest.approx(1.5)


def test_a_failing_environment_masks_its_conversation_and_a_bad_one_is_refused_before_any_work(made):
    rollout = made(environment="toolbox:BadStep")
    convs, turns = _start(rollout, ["1"])
    rollout._step_environment(list(enumerate(convs)), turns, 1, 0, ToolStats())
    assert convs[0].infra_failed and convs[0].done and "step() must return" in convs[0].calls[0]["answer"]
    rollout.calls.pool.release()
    with pytest.raises(ConfigError, match="'rollout.multi_turn.environment': toolbox:lookup is no class"):
        made(environment="toolbox:lookup")


def test_a_stateful_tool_keeps_its_state_and_a_step_run_again_rebuilds_it(made, tmp_path):
    rollout = made(tools=[{"stateful": "toolbox:Counter", "hidden": ["start"]}])
    assert list(rollout.schemas["Counter"]["function"]["parameters"]["properties"]) == ["by"]
    assert rollout.schemas["Counter"]["function"]["description"] == "Add to the counter and say its total."
    call = '<tool_call>{"name": "Counter", "arguments": {"by": %d}}</tool_call>'
    offer = Offer(hidden={"Counter": {"start": 10}})

    def run_step(record) -> list[str]:
        """Two turns of one conversation at step 5, the record as given; the tool's answers."""
        rollout.record = record
        record.begin(5)
        convs, turns = _start(rollout, [call % 2], offer=offer)
        rollout.calls.generation = 1  # the same generate call of the step, as a step run again numbers it
        rollout._answer(list(enumerate(convs)), turns, 5, 0, ToolStats(by_name={"Counter": 0}))
        turns = _said(rollout, convs, [call % 3])
        rollout._answer(list(enumerate(convs)), turns, 5, 1, ToolStats(by_name={"Counter": 0}))
        rollout.calls.pool.release()
        return [c["answer"] for c in convs[0].calls]

    run = Storage(str(tmp_path / "run"))
    try:
        first = run_step(ToolRecord(RunDir(run), 0))
        assert [a.split(" in ")[0] for a in first] == ["total 12", "total 15"]
        lines = (tmp_path / "run" / "tools" / "step-000005.rank-0.jsonl").read_bytes().splitlines()
        (tmp_path / "run" / "tools" / "step-000005.rank-0.jsonl").write_bytes(lines[0] + b"\n")  # killed then
        again = run_step(ToolRecord(RunDir(run), 0))  # resumed: the first call replayed, the object made anew
        assert again[0] == first[0] and again[1].split(" in ")[0] == "total 15"
    finally:
        rollout.record = None
    with pytest.raises(ConfigError, match=r"tools\[0\].hidden': 'secret' is not a parameter of toolbox:Counter"):
        made(tools=[{"stateful": "toolbox:Counter", "hidden": ["secret"]}])


def test_an_answer_with_no_room_left_is_none_in_the_calls_the_reward_reads(made):
    """A call that ran but whose answer does not fit in max_total_tokens: the conversation ends, and its
    call says the model never saw an answer (a reward counting answers must not count it)."""
    rollout = made(tools=[{"function": "toolbox:lookup"}], max_total_tokens=40)
    call = '<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>'
    convs, turns = _start(rollout, [call])
    assert len(turns[0]) < 40
    rollout._answer(list(enumerate(convs)), turns, 1, 0, ToolStats(by_name={"lookup": 0}))
    (c,) = convs
    assert c.done and c.ids == turns[0] and c.calls[0]["outcome"] == "ok" and c.calls[0]["answer"] is None
    assert [m["role"] for m in c.messages] == ["user", "assistant"]  # no tool message
