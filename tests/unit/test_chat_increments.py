"""A tool message as the ids the chat template adds for it, on a real byte-level BPE tokenizer with a
ChatML tool template: the increments built turn by turn equal the whole conversation's rendering; the
model's own tokens, kept as sampled, show up as drift at their first position when the whole rendering
tokenizes them otherwise; a template that does not render incrementally is a ConfigError (exit 3)."""

import pytest

from rlctl.engine.rollout.chat import ChatIncrements, first_drift, tool_message
from rlctl.errors import ConfigError, ExitCode

from chat_tokenizer import NOT_INCREMENTAL, build_chat_tokenizer

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("tok",)

SCHEMAS = [{"type": "function", "function": {"name": "lookup", "description": "capital", "parameters": {}}}]


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


def conversation_ids(chat: ChatIncrements, turns: list[list[int]], answers: list[str]):
    """The ids of a conversation built as the rollout builds it: the prompt's rendering, then each turn's
    model ids, the template's close and the tool's answer; and its messages."""
    messages = [{"role": "user", "content": "capital of peru?"}]
    ids = chat.encode(chat.render(messages, generation_prompt=True))
    mask = [0] * len(ids)
    for k, turn in enumerate(turns):
        ids += turn
        mask += [1] * len(turn)
        text = chat.tokenizer.decode([t for t in turn if t != chat.tokenizer.eos_token_id])
        messages.append({"role": "assistant", "content": text})
        if k < len(answers):
            env = chat.closing(turn) + chat.tool_ids([("lookup", answers[k])])
            ids += env
            mask += [0] * len(env)
            messages.append(tool_message("lookup", answers[k]))
    return ids, mask, messages


def test_increments_rebuild_the_whole_rendering(tok):
    chat = ChatIncrements(tok, SCHEMAS, "the test model")
    assert tok.decode(chat.close_ids) == "<|im_end|>\n"
    assert tok.decode(chat.tool_ids([("lookup", "lima")])) == (
        "<|im_start|>user\n<tool_response>\nlima\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    call = chat.encode('<tool_call>{"name": "lookup", "arguments": {"country": "peru"}}</tool_call>')
    answer = chat.encode("the capital of peru is lima.") + [tok.eos_token_id]
    ids, mask, messages = conversation_ids(chat, [call, answer], ["lima"])
    full = chat.encode(chat.render(messages))
    assert first_drift(ids, full) is None and full[len(ids) :] == chat.close_ids[1:]  # the last close is left
    # what the loss trains on: the model's tokens only (the eos ending its turn included); never the
    # template's close of the call's turn nor the tool's answer
    trained = tok.decode([t for t, m in zip(ids, mask) if m])
    assert trained == tok.decode(call) + "the capital of peru is lima.<|im_end|>"
    assert "<tool_response>" not in trained and trained.count("<|im_end|>") == 1


def test_a_turn_ended_by_eos_is_closed_by_the_rest_of_the_close(tok):
    chat = ChatIncrements(tok, [], "m")
    assert chat.closing([5, tok.eos_token_id]) == chat.close_ids[1:]
    assert chat.closing([5, 6]) == chat.close_ids


def test_drift_is_found_at_the_first_differing_token(tok):
    chat = ChatIncrements(tok, SCHEMAS, "m")
    merged = chat.encode("the capital of peru is lima.")
    spelled = [t for ch in "the capital of peru is lima." for t in chat.encode(ch)]  # the model sampled letters
    assert len(spelled) > len(merged)
    call = chat.encode('<tool_call>{"name": "lookup", "arguments": {}}</tool_call>')
    ids, _, messages = conversation_ids(chat, [call, spelled + [tok.eos_token_id]], ["lima"])
    full = chat.encode(chat.render(messages))
    at = first_drift(ids, full)
    start = len(ids) - len(spelled) - 1  # where the last turn begins
    prefix = next(i for i, (a, b) in enumerate(zip(spelled, merged)) if a != b)
    assert at == start + prefix
    assert first_drift([1, 2, 3], [1, 2]) == 2 and first_drift([1, 2], [1, 2, 3]) is None


def test_a_template_that_is_not_incremental_is_a_config_error(tok):
    bad = build_chat_tokenizer(NOT_INCREMENTAL)
    with pytest.raises(ConfigError) as err:
        ChatIncrements(bad, [], "the test model")
    assert err.value.exit_code == ExitCode.CONFIG
    assert err.value.message.startswith(
        "'rollout.multi_turn': the chat template of the test model cannot be rendered incrementally (an "
        "assistant message's rendering does not begin with the generation prompt)"
    )
