"""Multi-turn rollouts on the vllm backend, with a real in-process vLLM engine on the tiny chat model
(skipped without vllm): a turn continues the conversation's ids (the tools' answers included) as the HF
backend's does, token for token at temperature 0, and a whole generate keeps the model's log-probs
(the engine's, of the untruncated distribution) aligned with the mask, as the actor computes them."""

import pytest
import torch

from chat_tokenizer import tool_model_dir, tool_run_config

pytest.importorskip("vllm")

from rlctl.engine.actor import Actor, sequence_log_probs
from rlctl.engine.model import load_tokenizer
from rlctl.engine.rollout import make_backend
from rlctl.engine.rollout.conversation import Conversation
from rlctl.engine.rollout.multi_turn import MultiTurnRollout
from rlctl.engine.rollout.vllm_multi_turn import VLLMMultiTurnRollout
from rlctl.engine.tool_workers.loader import load_tools
from rlctl.engine.tool_workers.pool import ToolPool

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("both",)
pytestmark = pytest.mark.slow  # (real engines in this process: `make test` runs them, test-fast does not)

CALL = '<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>'


@pytest.fixture(scope="module")
def both(runtime, tmp_path_factory):
    """The vllm and the hf multi-turn rollouts of one actor (ZeRO-2) of the tiny chat model."""
    model_dir = tool_model_dir(tmp_path_factory.mktemp("tool-model"))
    cfg = tool_run_config(
        model_dir,
        max_prompt_length=256,
        backend="vllm",
        max_new_tokens=24,
        temperature=0.9,
        multi_turn={"tools": [{"function": "toolbox:lookup"}], "max_total_tokens": 160, "tool_workers": 1},
    )
    mt = cfg.rollout.multi_turn
    actor, tokenizer, tools = Actor(cfg, model_dir, runtime), load_tokenizer(model_dir), load_tools(mt)
    with ToolPool(1, mt.tool_timeout_s) as pool:
        vllm = make_backend(
            "vllm", cfg=cfg, actor=actor, tokenizer=tokenizer, model_dir=model_dir, tools=tools, pool=pool
        )
        assert isinstance(vllm, VLLMMultiTurnRollout)
        hf = MultiTurnRollout(cfg, actor, tokenizer, mt, tools, pool)
        yield vllm, hf, actor
        vllm.close()


def conversations(rollout) -> tuple[list[list[int]], list[Conversation]]:
    """Two conversations after a first turn that called the tool and got its answer (built as the rollout
    builds them), and their prompts' ids."""
    prompts = ["what is the capital of peru?", "and of italy?"]
    enc = rollout.encode(prompts)
    prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
    convs = [Conversation(p, (i, 0)) for i, p in enumerate(prompts)]
    turn = rollout.chat.encode(CALL)
    for c in convs:
        c.ids, c.model, c.log_probs = list(turn), [True] * len(turn), [0.0] * len(turn)
        rollout._append(c, turn, rollout.chat.tool_ids([("lookup", "lima")]))
    return prompt_ids, convs


def test_a_turn_after_a_tools_answer_is_the_hf_backends_turn_at_temperature_0(both):
    vllm, hf, _ = both
    (prompts, ours), (_, theirs) = conversations(vllm), conversations(hf)
    assert [c.ids for c in ours] == [c.ids for c in theirs]
    with vllm.weights_for_turns():
        got = vllm._generate_turn(prompts, ours, 3, 1, 0.0)
    with hf.weights_for_turns():
        want = hf._generate_turn(prompts, theirs, 3, 1, 0.0)
    assert got == want and all(len(t) > 0 for t in got)
    for a, b in zip(ours, theirs):
        assert torch.allclose(torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=1e-3)


def test_a_generate_keeps_the_engines_log_probs_aligned_with_the_mask(both):
    vllm, _, actor = both
    prompts = ["what is the capital of peru?", "what is the capital of japan?"]
    seqs = vllm.generate(prompts, [(0, 0), (1, 0)], step=1)
    assert seqs.rollout_log_probs is not None
    mask = seqs.response_mask.bool()
    assert mask.any() and (seqs.rollout_log_probs[~mask] == 0).all()
    with torch.no_grad():
        theirs = sequence_log_probs(actor.engine, seqs, 0.9)[0]
    assert torch.allclose(seqs.rollout_log_probs[mask], theirs[mask], atol=1e-3)
    metrics = vllm.take_metrics()
    assert metrics["multi_turn/num_turns/mean"] >= 1 and set(metrics) == set(vllm.reductions)
    again = vllm.generate(prompts, [(0, 0), (1, 0)], step=1)  # the same seeds: the same conversations
    assert torch.equal(again.input_ids, seqs.input_ids)
    vllm.take_metrics()
