"""Every check that can run before any work: ``check_before_start(cfg)``, called by ``start`` before the
run directory exists and by ``resume`` before the lease is taken, so a mistake leaves nothing behind
that would block a retry of the fixed command.

It checks, in seconds and without loading weights: the dataset files can be read; the configured
trackers are installed; the device asked for
is there (``device: cuda`` without a GPU) and takes ``model.dtype`` (fp16 on a CPU without oneDNN fp16), with a device for every local rank; the storage of
``checkpoint.dir`` has its filesystem installed; the model directory has a config and weights, and its
context holds ``data.max_prompt_length + rollout.max_new_tokens`` (``rollout.multi_turn.max_total_tokens``
in a multi-turn run); the tokenizer has the chat template
that ``data.apply_chat_template`` / ``data.system_prompt`` ask for; every tool of ``rollout.multi_turn``
imports and has a schema, and the chat template renders its messages incrementally; every reward function (the one of
``reward.function``, or each function source of ``reward.sources``) imports and is callable; every
reward model's directory holds a one-label sequence classifier, weights and a tokenizer (not loaded). A reward URL
is not contacted here (a server may come up with the run): the schema checks its syntax (http/https and
a host), and the first step says when it does not answer. The run directory and ``checkpoint.dir``, on
an object store, are opened and listed (``check_storage``): a bucket that does not exist, access
denied or bad credentials are a StorageRefused (exit 13) before any work, a store that does not answer a
StorageError (12).

First of all, what the config names outside itself (``check_config_names``): the model, critic and reward
model directories, the prompt files and a known storage protocol and well-formed URL for ``checkpoint.dir``. The config's
own validation checks shape and values only (a negative seed, a rollback policy without snapshots), so
that a run directory can be read anywhere, its data and models absent; these checks speak the sentence
that validation would, located where the key was written (``RunConfig.provenance``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import fsspec
from fsspec.core import split_protocol

from rlctl.config import RunConfig
from rlctl.config.provenance import Problem
from rlctl.engine.data import check_prompt_template, config_tokenizer, model_name
from rlctl.engine.model import BUILTIN_CONTEXT, check_weights_present, context_length, load_model_config
from rlctl.engine.reward.sources import load_reward
from rlctl.engine.runtime import check_local_ranks, check_rollout_device, resolve_device, resolve_dtype
from rlctl.errors import ConfigError, InputError, StorageError
from rlctl.storage.clients import EXTRAS, install_hint, url_problem
from rlctl.yamlsrc import origin_for

if TYPE_CHECKING:
    from rlctl.storage import Storage


def check_before_start(cfg: RunConfig, run: Storage | None = None) -> None:
    """ConfigError or InputError, one sentence each, for what would otherwise fail after work began;
    StorageRefused or StorageError for the storage of ``run`` (the run directory) or of
    ``checkpoint.dir`` that refuses or does not answer."""
    check_config_names(cfg)
    check_data(cfg)
    check_trackers(cfg)
    check_device(cfg)
    check_snapshot_storage(cfg)
    check_storage(cfg, run)
    check_models(cfg)
    check_prompt_template(cfg)
    check_multi_turn(cfg)
    load_reward(cfg.reward)  # imports each function source; contacts no URL


def check_multi_turn(cfg: RunConfig) -> None:
    """Under ``rollout.multi_turn``: every tool imports and its schema reads (a ConfigError naming its key),
    and the chat template renders the prompt with the tools' schemas and a tool's answer as increments
    (a ConfigError, exit 3, for one that cannot)."""
    mt = cfg.rollout.multi_turn
    if mt is None:
        return
    from rlctl.engine.rollout.chat import ChatIncrements
    from rlctl.engine.tool_workers.loader import load_tools

    tools = load_tools(mt)
    ChatIncrements(config_tokenizer(cfg), list(tools.schemas.values()), model_name(cfg))


def check_config_names(cfg: RunConfig) -> None:
    """One ConfigError, in the words and at the place of a validation error, for every directory, file
    and storage protocol the config names that is not on this machine."""
    problems: list[Problem] = []
    if cfg.model.path is not None and not Path(cfg.model.path).expanduser().is_dir():
        problems.append((("model", "path"), f"no such model directory: {cfg.model.path}"))
    for key, value in (("path", cfg.data.path), ("val_path", cfg.data.val_path)):
        if value is not None and (problem := data_problem(value)) is not None:
            problems.append((("data", key), problem))
    problems += reward_model_problems(cfg)
    if cfg.checkpoint.dir is not None and (problem := url_problem(cfg.checkpoint.dir)) is not None:
        problems.append((("checkpoint", "dir"), problem))
    if cfg.critic.path is not None and not Path(cfg.critic.path).expanduser().is_dir():
        problems.append(((), f"critic.path: no such model directory: {cfg.critic.path}"))
    if problems:
        raise cfg.provenance.error(problems)


def data_problem(value: str) -> str | None:
    """What is wrong with a prompt file or ``datasets`` directory named ``value``, or None."""
    p = Path(value).expanduser()
    if p.is_dir():
        if not (p / "dataset_info.json").is_file() and not (p / "dataset_dict.json").is_file():
            return f"{value} is a directory but not a `datasets` directory (save_to_disk)"
        return None
    if not p.is_file():
        return f"no such file: {value}"
    if p.suffix not in (".jsonl", ".json", ".parquet"):
        return f"expected a .jsonl or .parquet file, got {p.name}"
    return None


def reward_model_problems(cfg: RunConfig) -> list[Problem]:
    """A reward model directory (of ``reward.model`` or a source's ``model``) that is not there."""
    models = [(("reward", "model", "path"), cfg.reward.model)]
    models += [
        (("reward", "sources", str(i), "model", "path"), s.model) for i, s in enumerate(cfg.reward.sources or [])
    ]
    return [
        (key, f"no such model directory: {model.path}")
        for key, model in models
        if model is not None and not Path(model.path).expanduser().is_dir()
    ]


def check_data(cfg: RunConfig) -> None:
    """The dataset files can be opened and read (they may have moved since the config was written)."""
    for key, value in (("data.path", cfg.data.path), ("data.val_path", cfg.data.val_path)):
        if value is None:
            continue
        path = Path(value).expanduser()
        try:
            if path.is_dir():
                next(path.iterdir(), None)
            else:
                with open(path, "rb") as fh:
                    fh.read(1)
        except OSError as exc:
            raise InputError(f"cannot read '{key}' {path}: {exc.strerror or exc}") from None


def check_trackers(cfg: RunConfig) -> None:
    """Every tracker of ``trainer.loggers`` is installed (nothing is imported to find out)."""
    if not cfg.trainer.loggers:
        return
    from rlctl.trackers import missing

    problems = missing(cfg.trainer.loggers)
    if problems:
        raise ConfigError(f"'trainer.loggers': {'; '.join(problems)}")


def check_device(cfg: RunConfig) -> None:
    """The device asked for is on this machine, one for every local rank, and the rollout backend runs
    on it. Under Ray the ranks run elsewhere: their own start-up checks their devices."""
    if cfg.cluster.backend != "local":
        return
    kind = resolve_device(cfg.device)
    resolve_dtype(cfg.model.dtype, kind)  # fp16 where DeepSpeed refuses it: a ConfigError naming model.dtype
    check_local_ranks(cfg.device, cfg.world_size)
    check_rollout_device(kind, cfg.rollout.backend)


def check_snapshot_storage(cfg: RunConfig) -> None:
    """The filesystem of ``checkpoint.dir`` is installed (gs:// needs gcsfs, s3:// s3fs). That the
    protocol exists at all is ``check_config_names``'s check."""
    if cfg.checkpoint.dir is None:
        return
    for part in cfg.checkpoint.dir.split("::"):
        protocol = split_protocol(part)[0]
        if protocol is None:
            continue
        try:
            fsspec.get_filesystem_class(protocol)
        except (ImportError, ValueError) as exc:
            how = f"{install_hint(protocol)} ({exc})" if protocol in EXTRAS else str(exc)
            raise ConfigError(
                f"'checkpoint.dir' is {cfg.checkpoint.dir}, but the {protocol}:// filesystem is not available: {how}"
            ) from None


def check_storage(cfg: RunConfig, run: Storage | None) -> None:
    """The run directory (``run``) and ``checkpoint.dir`` answer, their buckets exist and they may be
    listed (``Storage.check_reachable``; nothing to check on a local disk): a StorageRefused naming the
    key for a refusal (a missing bucket, access denied, bad credentials), a StorageError for a store that
    does not answer within ``checkpoint.retry_timeout``."""
    from rlctl.storage import Storage

    c = cfg.checkpoint
    if run is not None:
        run.check_reachable()
    if c.dir is None:
        return
    snapshots = Storage(c.dir, c.storage_options, retry_timeout=c.retry_timeout)
    try:
        snapshots.check_reachable()
    except StorageError as exc:
        where = origin_for(("checkpoint", "dir"), cfg.provenance.origins)
        raise type(exc)(f"'checkpoint.dir'{where}: {exc.message}") from exc


def check_models(cfg: RunConfig) -> None:
    """The model (and a PPO critic's own model) directory has a config and weights, and the model's
    context holds the longest prompt plus the longest completion."""
    if cfg.model.path is None:
        check_context(cfg, ("max_position_embeddings", BUILTIN_CONTEXT), "the built-in model")
    else:
        model_dir = Path(cfg.model.path).expanduser()
        config = load_model_config(model_dir, cfg.model.trust_remote_code)
        check_weights_present(model_dir)
        check_context(cfg, context_length(config), f"the model in {model_dir}")
    if cfg.algorithm.name == "ppo" and cfg.critic.path is not None:
        critic_dir = Path(cfg.critic.path).expanduser()
        load_model_config(critic_dir, cfg.model.trust_remote_code)
        check_weights_present(critic_dir)


def check_context(cfg: RunConfig, limit: tuple[str, int] | None, model: str) -> None:
    """A ConfigError naming both keys when prompt plus completion exceed the model's positions."""
    if limit is None:  # the model declares no limit: nothing to check against
        return
    key, positions = limit
    mt = cfg.rollout.multi_turn  # a conversation: the tools' tokens and the model's after the prompt
    after, new = (
        ("rollout.multi_turn.max_total_tokens", mt.max_total_tokens)
        if mt
        else ("rollout.max_new_tokens", cfg.rollout.max_new_tokens)
    )
    prompt = cfg.data.max_prompt_length
    if prompt + new > positions:
        raise ConfigError(
            f"'data.max_prompt_length' ({prompt}) + '{after}' ({new}) = {prompt + new} tokens "
            f"exceed the {positions} positions of {model} ({key}); lower them to fit"
        )
