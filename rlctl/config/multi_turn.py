"""``rollout.multi_turn``: conversations in which the model calls tools between its turns.

The shape and values are checked here; whether a tool's module imports, what its signature says and
whether the chat template renders a tool message incrementally are the preflight's questions
(``rlctl.preflight``), so a run's saved config reads anywhere without importing a tool. A tool
file (``tools_file``) is read and inlined when the config is loaded (``load.inline_tool_file``), as a
policy file is: the run directory never depends on where it lived.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from rlctl.config.sandbox import SandboxConfig
from rlctl.config.strict import Strict, check_import_path
from rlctl.tools.formats import FORMATS

ToolFormat = Literal["hermes", "qwen3_coder"]  # FORMATS' names (tests/unit/test_tool_formats.py keeps them equal)
TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class ToolConfig(Strict):
    function: str | None = Field(
        None,
        description="A plain Python function as `module:function`, run in a worker process per call; its JSON "
        "schema is read from its signature (type hints) and docstring (first paragraph: the description; an "
        "Args: section: each parameter's).",
    )
    stateful: str | None = Field(
        None,
        description="A stateful tool as `module:Class`: one object per conversation, made at its first call "
        "(`Class()`, then `create(**hidden values)` if it has one), asked `call(**arguments)` (its schema: "
        "call's signature and docstring) and given `release()` when the conversation's rollout ends.",
    )
    name: str | None = Field(
        None, description="The name the model calls it by (default: the function's name); also in tool/<name>/calls."
    )
    hidden: list[str] = Field(
        default_factory=list,
        description="Parameters of the function that the model neither sees nor fills: left out of its schema, "
        "each call gets them from the prompt's row (multi_turn.tool_args_column), e.g. the answer a checker "
        "compares with. For a stateful tool: parameters of its create(), given once per conversation.",
    )

    @field_validator("function")
    @classmethod
    def _module_function(cls, v: str | None) -> str | None:
        return None if v is None else check_import_path(v, "function")

    @field_validator("stateful")
    @classmethod
    def _module_class(cls, v: str | None) -> str | None:
        return None if v is None else check_import_path(v, "Class")

    @field_validator("name")
    @classmethod
    def _metric_name(cls, v: str | None) -> str | None:
        if v is not None and not (v and set(v) <= TOOL_NAME_CHARS):
            raise ValueError(f"expected letters, digits, '_' or '-' (it becomes a metric name), got {v!r}")
        return v

    @model_validator(mode="after")
    def _a_function(self) -> ToolConfig:
        if (self.function is None) == (self.stateful is None):
            given = "both" if self.function is not None else "neither"
            raise ValueError(
                f"give the tool's 'function' (module:function) or 'stateful' (module:Class), one of them ({given} given)"
            )
        return self

    @property
    def spec(self) -> str:
        """What the workers import: ``module:function`` or ``module:Class``."""
        return self.function if self.function is not None else self.stateful  # type: ignore[return-value]

    @property
    def label(self) -> str:
        """The tool's name: its own, else the function's or the class's."""
        return self.name if self.name is not None else self.spec.partition(":")[2]


class MultiTurnConfig(Strict):
    max_turns: int = Field(
        4, ge=1, description="Assistant turns per conversation at most; a call in the last one is not run."
    )
    max_tool_response_tokens: int = Field(
        256,
        ge=1,
        description="A tool's answer is cut to this many tokens (of the model's tokenizer) before the model sees it.",
    )
    max_total_tokens: int = Field(
        1024,
        ge=1,
        description="Tokens after the prompt at most, the model's and the tools' together; the model's own are "
        "capped by rollout.max_new_tokens over all its turns.",
    )
    tool_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Seconds one tool call may run; its worker process is then killed (CPU-bound code "
        "included) and the model is told it timed out.",
    )
    max_parallel_calls: int = Field(
        1,
        ge=1,
        description="Tool calls run per assistant turn at most (the rest are answered with an error). With 1, "
        "generation stops at the end of the first call; above 1, at the end of the turn.",
    )
    tool_workers: int = Field(2, ge=1, description="Worker processes of each rank that run tool calls (concurrently).")
    tool_retry_budget: int = Field(
        3,
        ge=0,
        description="Steps in a row in which every tool call that ran ended in an infrastructure failure "
        "(timed out or unavailable; at least one call ran) that the run rides out. One more such step and "
        "the run ends as a preemption does: the step's snapshot committed, a tools_unavailable event, "
        "exit 75; `rlctl resume` continues it (0: end at the first such step). The count starts again at "
        "a resume.",
    )
    format: ToolFormat = Field(
        "hermes",
        description='How the model writes a call: hermes (<tool_call>{"name": ..., "arguments": {...}}'
        "</tool_call>) or qwen3_coder (<tool_call><function=NAME><parameter=ARG>VALUE</parameter></function>"
        "</tool_call>).",
    )
    tools: list[ToolConfig] = Field(
        default_factory=list,
        description="The tools the model may call (with those of tools_file); none with an environment.",
    )
    tools_column: str | None = Field(
        "tools",
        description="A dataset column listing, per prompt, the names of the tools offered to it: only their "
        "schemas are in its prompt, and a call to another is an error the model reads. A row without it (or "
        "null) gets every tool; null here: every prompt gets every tool.",
    )
    tool_args_column: str | None = Field(
        "tool_args",
        description="A dataset column mapping, per prompt, a tool's name to values of its hidden parameters "
        "(tools[].hidden), given to every call of that tool and never shown to the model.",
    )
    tools_file: str | None = Field(
        None,
        description="A YAML file holding a list of tools (as in `tools`), read and inlined into `tools` when the "
        "config is loaded.",
    )
    sandbox: SandboxConfig = Field(
        default_factory=SandboxConfig,
        description="Where the built-in python tool (rlctl.tools.python) runs the model's code, and its limits.",
    )
    environment: str | None = Field(
        None,
        description="An environment as `module:Class` answering each of the model's turns instead of tools: "
        "one object per conversation (`Class()`, then `reset(**the row's env_args)`), asked `step(text of the "
        "turn)` -> (observation, reward, done); the observation is the next user message, the reward is that "
        "turn's (on its last token), done ends the conversation; `close()` when its rollout ends.",
    )
    env_args_column: str | None = Field(
        "env_args",
        description="A dataset column holding, per prompt, the keyword arguments of the environment's reset() "
        "(e.g. the game's secret). A row without it (or null) resets with none.",
    )

    @field_validator("environment")
    @classmethod
    def _module_class(cls, v: str | None) -> str | None:
        return None if v is None else check_import_path(v, "Class")

    @model_validator(mode="after")
    def _tools_fit(self) -> MultiTurnConfig:
        names = [t.label for t in self.tools]
        if dupes := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tool names must be unique (repeated: {', '.join(dupes)}); set 'name' to tell them apart")
        if self.tools_file is not None:
            raise ValueError(
                f"tools_file ({self.tools_file}) is read when a config file is loaded (rlctl start CONFIG); "
                "here, list the tools under 'tools'"
            )
        if self.environment is not None and self.tools:
            raise ValueError(f"the environment ({self.environment}) answers every turn: declare it or tools, not both")
        if not self.tools and self.environment is None:
            raise ValueError("declare at least one tool ('tools' or 'tools_file') or an 'environment'")
        jailed = any(t.spec.startswith("rlctl.tools.python:") for t in self.tools)  # (the built-in python tool)
        if jailed and self.sandbox.wall_time_s >= self.tool_timeout_s:
            raise ValueError(
                f"sandbox.wall_time_s ({self.sandbox.wall_time_s:g}) must be under tool_timeout_s "
                f"({self.tool_timeout_s:g}): code that runs too long is the model's error, a tool timeout is not"
            )
        if self.format not in FORMATS:  # the Literal above and the registry drifted apart
            raise ValueError(f"unknown tool-call format '{self.format}'; valid: {', '.join(FORMATS.names)}")
        return self
