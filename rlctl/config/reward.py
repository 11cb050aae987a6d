"""The reward's config: one function, URL or reward model (the single-source shorthand), or weighted
sources. The syntax of a function name and a URL is checked here; that a function imports, a URL
answers or a model directory holds a reward model is the preflight's question."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from rlctl.config.strict import Strict, check_import_path

DEFAULT_REWARD = "rlctl.engine.reward.builtin:echo_reward"
# a run whose environment gives every reward (rollout.multi_turn.environment and no reward of its own)
NO_REWARD = "rlctl.engine.reward.builtin:no_reward"
REWARD_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _check_reward_url(v: str) -> str:
    """An http:// or https:// URL with a host, else a ValueError (it is not contacted here)."""
    parts = urlsplit(v)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http:// or https:// URL with a host, got {v!r}")
    return v


class RewardModelConfig(Strict):
    path: str = Field(
        description="Local Hugging Face sequence-classification model directory (num_labels 1) with its tokenizer."
    )
    dtype: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Precision of the reward model: auto is bf16 on CUDA and NPU with native bf16, else fp32."
    )
    batch_size: int = Field(16, ge=1, description="Completions scored per forward pass (per rank).")


class RewardSourceConfig(Strict):
    function: str | None = Field(
        None, description="Reward function as `module:function` (exactly one of function, url and model)."
    )
    url: str | None = Field(
        None, description='HTTP(S) endpoint POSTed the batch as JSON, answering {"scores": [...]} (one of three).'
    )
    model: RewardModelConfig | None = Field(
        None, description="A sequence-classification reward model scoring prompt + completion (one of three)."
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments (a URL receives them as the body's `kwargs`)."
    )
    weight: float = Field(1.0, allow_inf_nan=False, description="Weight of this source in the step's summed score.")
    name: str | None = Field(
        None,
        description="Name in `critic/score/<name>/mean`; default: the function's name, the URL's host or the "
        "model directory's name.",
    )
    timeout: float = Field(30.0, gt=0, description="URL only: seconds to wait for one request's answer.")
    retries: int = Field(
        3, ge=0, description="URL only: retries (exponential backoff) on connection errors, timeouts, 5xx and 429."
    )

    @field_validator("function")
    @classmethod
    def _module_function(cls, v: str | None) -> str | None:
        return None if v is None else check_import_path(v, "function")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return None if v is None else _check_reward_url(v)

    @field_validator("name")
    @classmethod
    def _metric_name(cls, v: str | None) -> str | None:
        if v is not None and not (v and set(v) <= REWARD_NAME_CHARS):
            raise ValueError(f"expected letters, digits, '_', '.' or '-' (it becomes a metric name), got {v!r}")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSourceConfig:
        if [self.function, self.url, self.model].count(None) != 2:
            raise ValueError("give exactly one of 'function', 'url' and 'model'")
        if self.model is not None and self.kwargs:
            raise ValueError("'kwargs' apply to a 'function' or 'url' source, not to a 'model'")
        if self.url is None and (self.timeout != 30.0 or self.retries != 3):  # (defaults: a resolved config)
            raise ValueError("'timeout' and 'retries' apply to a 'url' source only")
        return self

    @property
    def label(self) -> str:
        """The source's name: its own, else the function's name or the URL's host."""
        if self.name is not None:
            return self.name
        if self.function is not None:
            return self.function.partition(":")[2]
        if self.model is not None:
            name = "".join(c if c in REWARD_NAME_CHARS else "_" for c in Path(self.model.path).expanduser().name)
            return name or "model"
        return urlsplit(self.url).hostname or "url"


class RewardConfig(Strict):
    function: str = Field(
        DEFAULT_REWARD,
        description="Reward function as `module:function`, called as "
        "fn(prompts, completions, **columns) -> list[float] (single-source shorthand).",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict, description="Extra keyword arguments for `function` (or sent to `url`)."
    )
    url: str | None = Field(
        None, description="HTTP(S) reward endpoint (single-source shorthand): POSTed the batch, answers scores."
    )
    timeout: float = Field(30.0, gt=0, description="With `url`: seconds to wait for one request's answer.")
    retries: int = Field(
        3, ge=0, description="With `url`: retries (exponential backoff) on connection errors, timeouts, 5xx and 429."
    )
    model: RewardModelConfig | None = Field(
        None,
        description="A sequence-classification reward model scoring prompt + completion (single-source shorthand).",
    )
    sources: list[RewardSourceConfig] | None = Field(
        None, description="Weighted reward sources, summed; each source's mean is logged as critic/score/<name>/mean."
    )

    @field_validator("function")
    @classmethod
    def _module_function(cls, v: str) -> str:
        return check_import_path(v, "function")

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        return None if v is None else _check_reward_url(v)

    @model_validator(mode="after")
    def _one_form(self) -> RewardConfig:
        # told apart from the defaults, not by what a file names: a resolved config (RUN_DIR/config.yaml)
        # writes every key, defaults included, and must load again
        function = self.function != DEFAULT_REWARD
        if self.sources is not None:
            clash = (["function"] if function else []) + (["url"] if self.url is not None else [])
            clash += (["model"] if self.model is not None else []) + (["kwargs"] if self.kwargs else [])
            if clash:
                raise ValueError(f"give either 'sources' or {' and '.join(map(repr, clash))}, not both")
            if not self.sources:
                raise ValueError("'sources' is empty: give at least one source")
            names = [s.label for s in self.sources]
            if dupes := sorted({n for n in names if names.count(n) > 1}):
                raise ValueError(
                    f"source names must be unique (repeated: {', '.join(dupes)}); set 'name' to tell them apart"
                )
        elif sum((function, self.url is not None, self.model is not None)) > 1:
            given = [k for k, on in (("function", function), ("url", self.url), ("model", self.model)) if on]
            raise ValueError(f"give one of {' and '.join(map(repr, given))}, not both (or list them under 'sources')")
        elif self.model is not None and self.kwargs:
            raise ValueError("'kwargs' apply to 'function' or 'url', not to 'model'")
        if self.url is None and (self.timeout != 30.0 or self.retries != 3):
            raise ValueError("'timeout' and 'retries' apply with 'url' only (a URL source has its own)")
        return self

    def source_list(self) -> list[RewardSourceConfig]:
        """The sources to score with: ``sources``, or the one that ``url``, ``model`` or ``function`` names."""
        if self.sources is not None:
            return list(self.sources)
        if self.url is not None:
            return [RewardSourceConfig(url=self.url, kwargs=self.kwargs, timeout=self.timeout, retries=self.retries)]
        if self.model is not None:
            return [RewardSourceConfig(model=self.model)]
        return [RewardSourceConfig(function=self.function, kwargs=self.kwargs)]
