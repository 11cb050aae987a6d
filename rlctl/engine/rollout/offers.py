"""Which tools each prompt is offered, and the hidden arguments its calls get, from the prompt's row.

A dataset may give each prompt its own tools (``rollout.multi_turn.tools_column``, default ``tools``: a
list of tool names; the prompt is rendered with those tools' schemas only, and a call to another is an
error the model reads) and values of the tools' hidden parameters (``tool_args_column``, default
``tool_args``: ``{tool: {parameter: value}}``, e.g. the answer a checker compares with: given to each
call of that tool, never shown to the model; ``tools[].hidden`` names them). A row without either gets
every tool and no hidden values. A value of the wrong shape, an unknown tool or a parameter that is not
one of the tool's hidden ones is an InputError (exit 4) naming the prompt's index and the column. With an
environment, ``env_args_column`` (default ``env_args``) gives each prompt its reset()'s arguments.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlctl.config.multi_turn import MultiTurnConfig
from rlctl.engine.rollout.chat import ChatIncrements
from rlctl.engine.tool_workers.loader import Tools
from rlctl.errors import InputError


@dataclass(frozen=True)
class Offer:
    tools: tuple[str, ...] | None = None  # the names offered (None: every tool)
    hidden: dict[str, dict[str, Any]] = field(default_factory=dict)  # tool -> hidden parameter values


EVERY_TOOL = Offer()


class Offers:
    """The offers of a run's prompts, and a chat template's increments for each set of tools offered."""

    def __init__(self, mt: MultiTurnConfig, tools: Tools, tokenizer, model: str):
        self.mt, self.tools, self.tokenizer, self.model = mt, tools, tokenizer, model
        self._chats: dict[tuple[str, ...] | None, ChatIncrements] = {}

    def chat(self, offer: Offer) -> ChatIncrements:
        """The increments of the chat template rendered with the offered tools' schemas (made once per set)."""
        if offer.tools not in self._chats:
            names = offer.tools if offer.tools is not None else tuple(self.tools.schemas)
            schemas = [self.tools.schemas[n] for n in names]
            self._chats[offer.tools] = ChatIncrements(self.tokenizer, schemas, self.model)
        return self._chats[offer.tools]

    def schemas(self, offer: Offer) -> dict[str, dict[str, Any]]:
        if offer.tools is None:
            return self.tools.schemas
        return {n: self.tools.schemas[n] for n in offer.tools}

    def of(self, columns: dict[str, list] | None, keys: list[tuple[int, int]]) -> list[Offer]:
        """Each prompt's offer, from its row's columns (aligned with ``keys``)."""
        columns = columns or {}
        names = columns.get(self.mt.tools_column) if self.mt.tools_column else None
        args = columns.get(self.mt.tool_args_column) if self.mt.tool_args_column else None
        if names is None and args is None:
            return [EVERY_TOOL] * len(keys)
        return [
            Offer(
                self._names(names[i] if names is not None else None, key[0]),
                self._hidden(args[i] if args is not None else None, key[0]),
            )
            for i, key in enumerate(keys)
        ]

    def _names(self, value: Any, index: int) -> tuple[str, ...] | None:
        if value is None:
            return None
        where = f"prompt {index}'s '{self.mt.tools_column}'"
        if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
            raise InputError(f"{where} must be a list of tool names, got {value!r}")
        unknown = [n for n in value if n not in self.tools.schemas]
        if unknown:
            raise InputError(
                f"{where} names tools the run does not declare: {', '.join(unknown)} (its tools: "
                f"{', '.join(self.tools.schemas)})"
            )
        return tuple(dict.fromkeys(value))

    def _hidden(self, value: Any, index: int) -> dict[str, dict[str, Any]]:
        if value is None:
            return {}
        where = f"prompt {index}'s '{self.mt.tool_args_column}'"
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise InputError(f"{where} must map a tool's name to its hidden parameters' values, got {value!r}")
        for tool, params in value.items():
            allowed = self.tools.hidden.get(tool, ())
            extra = [p for p in params if p not in allowed]
            if extra:
                raise InputError(
                    f"{where} gives {tool} the parameters {', '.join(extra)}, which are not among its hidden ones "
                    f"({', '.join(allowed) or 'none'}: rollout.multi_turn.tools[].hidden)"
                )
        return value

    def env_args(self, columns: dict[str, list] | None, keys: list[tuple[int, int]]) -> list[dict[str, Any]]:
        """Each prompt's keyword arguments of the environment's reset(), from its row (``env_args_column``;
        {} without). A value that is no mapping of names is an InputError naming the prompt and column."""
        column = self.mt.env_args_column
        values = (columns or {}).get(column) if column and self.tools.environment is not None else None
        if values is None:
            return [{} for _ in keys]
        out = []
        for value, key in zip(values, keys):
            if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
                raise InputError(
                    f"prompt {key[0]}'s '{column}' must map the environment's reset() parameters to values, "
                    f"got {value!r}"
                )
            out.append(dict(value or {}))
        return out
