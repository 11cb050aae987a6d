"""A conversation kept as token ids: what the chat template adds for a tool message (or an environment's
observation, a user message), and the drift check.

Token in, token out: the model's own tokens are never re-tokenized. A tool message is rendered as the
text the chat template adds for it, the difference between a fixed base conversation rendered with and
without it (the next assistant turn's opening included), and appended as the ids of that text. The text
the template puts after an assistant message's content (``<|im_end|>\\n``) closes a turn the model
ended at a call; the model's own end of turn (its eos) counts as the first of those tokens. A template
that does not render incrementally (the base with a message added does not begin with the base) is a
ConfigError before any work (``check_incremental``).

The drift check renders a finished conversation whole and compares its ids with the trajectory's:
tokenization at the joins (a merge across a message boundary) or a template that renders an earlier
message differently later shows up as the first differing position.
"""

from __future__ import annotations

from typing import Any

from rlctl.errors import ConfigError

BASE = [{"role": "user", "content": "What is 1 + 1?"}]
PROBE = "Let me check."


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


def tool_message(name: str, content: str) -> dict[str, str]:
    return {"role": "tool", "name": name, "content": content}


class ChatIncrements:
    """The chat template of ``tokenizer`` (the tools' ``schemas`` passed to it, as a prompt's rendering
    passes them) rendered as increments. ``model`` names it in sentences."""

    def __init__(self, tokenizer, schemas: list[dict[str, Any]], model: str):
        self.tokenizer, self.schemas, self.model = tokenizer, schemas or None, model
        opened = self.render(BASE, generation_prompt=True)
        closed = self.render([*BASE, _assistant(PROBE)])
        if not closed.startswith(opened + PROBE):
            raise self._not_incremental("an assistant message's rendering does not begin with the generation prompt")
        self.close_ids = self.encode(closed[len(opened) + len(PROBE) :])
        self.tool_ids([("probe", "42")])  # the same question, asked of a tool message now
        self.user_ids("42")  # and of a user message (an environment's observation)

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.schemas, tokenize=False, add_generation_prompt=generation_prompt
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def tool_ids(self, results: list[tuple[str, str]]) -> list[int]:
        """The ids the template adds for tool messages ``(name, content)`` after an assistant turn, with
        the next assistant turn's opening."""
        return self.message_ids([tool_message(n, c) for n, c in results])

    def user_ids(self, content: str) -> list[int]:
        """The ids the template adds for a user message after an assistant turn (an environment's
        observation), with the next assistant turn's opening."""
        return self.message_ids([{"role": "user", "content": content}])

    def message_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        base = [*BASE, _assistant(PROBE)]
        before = self.render(base)
        after = self.render([*base, *messages], generation_prompt=True)
        if not after.startswith(before):
            role = messages[0]["role"] if messages else "a"
            raise self._not_incremental(f"adding a {role} message changes how the messages before it are rendered")
        return self.encode(after[len(before) :])

    def closing(self, turn: list[int]) -> list[int]:
        """The template's tokens that close an assistant turn whose model tokens are ``turn``: all of
        ``close_ids``, or those after the first when the model ended its turn with it (its eos)."""
        if turn and self.close_ids and turn[-1] == self.close_ids[0]:
            return self.close_ids[1:]
        return list(self.close_ids)

    def _not_incremental(self, why: str) -> ConfigError:
        return ConfigError(
            f"'rollout.multi_turn': the chat template of {self.model} cannot be rendered incrementally ({why}), "
            "so a tool's answer cannot be appended as tokens; use a model whose template renders each message "
            "on its own (ChatML, Qwen, Llama 3 style)"
        )


def first_drift(ours: list[int], full: list[int]) -> int | None:
    """The first position where the trajectory's ids ``ours`` differ from the whole conversation's
    rendering ``full`` (which may go on past them: the close of the last turn), or None."""
    for i, (a, b) in enumerate(zip(ours, full)):
        if a != b:
            return i
    return None if len(full) >= len(ours) else len(full)
