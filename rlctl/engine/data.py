"""Prompt datasets with a resumable cursor.

Rows are dicts with at least the prompt column (a string); every other column is passed to the reward
function. The cursor walks a seeded permutation of the rows, reshuffled every epoch; its state is
(epoch, position, seed), so a restored run draws exactly the prompts it would have drawn.

What the model is given for a prompt (``prompt_texts``) is the prompt itself, or under
``data.apply_chat_template`` the tokenizer's chat template applied to [system (``data.system_prompt``),
user] messages; the reward function still receives the prompt as the dataset holds it. With
``data.filter_overlong_prompts`` the prompts longer than ``data.max_prompt_length`` tokens (so measured)
are dropped once, at load, before the cursor numbers the rows (``load_prompts``): a resumed run filters
the same files the same way and draws the same prompts.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rlctl import events
from rlctl.config import DataConfig, RunConfig
from rlctl.errors import ConfigError, InputError
from rlctl.stateful import check_version


def load_rows(cfg: DataConfig, seed: int) -> list[dict[str, Any]]:
    """The training prompts: ``data.path``, or the built-in task."""
    if cfg.path is None:
        return builtin_task(cfg).make_prompts(cfg.builtin_size, seed)
    return read_prompt_file(Path(cfg.path).expanduser(), cfg.prompt_key, "data.path", TRAIN_SPLITS)


def load_val_rows(cfg: DataConfig, seed: int, training: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out prompts: ``data.val_path``, or the built-in task's held-out split (prompts of its own,
    none of which is among the ``training`` rows)."""
    if cfg.val_path is not None:
        return read_prompt_file(Path(cfg.val_path).expanduser(), cfg.prompt_key, "data.val_path", VAL_SPLITS)
    return builtin_task(cfg).make_held_out_prompts(cfg.builtin_val_size, seed, training)


def builtin_task(cfg: DataConfig):
    """The module of the built-in task ``data.builtin_task``: its ``make_prompts`` and ``make_held_out_prompts``."""
    if cfg.builtin_task == "lookup":
        from rlctl.engine.reward import lookup

        return lookup
    from rlctl.engine.reward import builtin

    return builtin


@dataclass(frozen=True)
class Filtered:
    """What ``data.filter_overlong_prompts`` dropped from one dataset (``key``: the config key naming it)."""

    key: str
    source: str
    total: int
    dropped: int
    limit: int
    longest: int

    def event(self) -> dict[str, Any]:
        """The ``prompts_filtered`` event of events.jsonl."""
        return {
            "event": events.PROMPTS_FILTERED,
            "data": self.key,
            "file": self.source,
            "prompts": self.total,
            "dropped": self.dropped,
            "kept": self.total - self.dropped,
            "max_prompt_length": self.limit,
            "longest": self.longest,
        }

    def note(self) -> str:
        """The line said on stderr."""
        return (
            f"'{self.key}' {self.source}: dropped {self.dropped} of {self.total} prompts longer than "
            f"{self.limit} tokens (data.filter_overlong_prompts; the longest has {self.longest})"
        )


@dataclass(frozen=True)
class Prompts:
    """A run's prompts as loaded: the training rows (the cursor's), the validation rows (None when the run
    does not validate), and what filtering dropped from each."""

    train: list[dict[str, Any]]
    val: list[dict[str, Any]] | None
    filtered: list[Filtered]

    def announce(self, emit: Callable[[dict[str, Any]], None], main: bool) -> None:
        """Record what filtering dropped: an event each (``emit``), and a line on stderr (``main``)."""
        for f in self.filtered:
            emit(f.event())
            if main:
                print(f.note(), file=sys.stderr)


def load_prompts(cfg: RunConfig, tokenizer, tools: list[dict[str, Any]] | None = None) -> Prompts:
    """The training and (when the run validates) validation prompts, with the chat template checked
    (``check_chat_template``) and, under ``data.filter_overlong_prompts``, the overlong prompts dropped: the
    same every time for the same files, tokenizer and config. ``tools``: the schemas of
    ``rollout.multi_turn``'s tools, which the template renders into every prompt (their length counts)."""
    data = cfg.data
    check_chat_template(tokenizer, data, model_name(cfg))
    rows = load_rows(data, cfg.seed)
    val = load_val_rows(data, cfg.seed, rows) if cfg.validates else None  # the split ignores the filter
    if not data.filter_overlong_prompts:
        return Prompts(rows, val, [])
    train, filtered = drop_overlong(rows, tokenizer, data, "data.path", data.path or "the built-in task", tools)
    if val is None:
        return Prompts(train, None, [filtered])
    val_source = data.val_path or "the built-in task's held-out split"
    val, val_filtered = drop_overlong(val, tokenizer, data, "data.val_path", val_source, tools)
    return Prompts(train, val, [filtered, val_filtered])


def prompt_messages(cfg: DataConfig, prompt: str) -> list[dict[str, str]]:
    """The conversation a prompt becomes under the chat template: [system (data.system_prompt), user]."""
    user = {"role": "user", "content": prompt}
    return [{"role": "system", "content": cfg.system_prompt}, user] if cfg.system_prompt is not None else [user]


def prompt_texts(
    tokenizer, cfg: DataConfig, prompts: list[str], tools: list[dict[str, Any]] | None = None
) -> list[str]:
    """The text the model is given for each prompt: the prompt itself, or (data.apply_chat_template) the
    chat template's rendering of its ``prompt_messages`` (with the ``tools``' schemas, under
    rollout.multi_turn), ending where the assistant's answer begins. Encode it with
    ``add_special_tokens=not cfg.apply_chat_template`` (a template writes its own)."""
    if not cfg.apply_chat_template:
        return list(prompts)
    return [
        tokenizer.apply_chat_template(
            prompt_messages(cfg, p), tools=tools or None, tokenize=False, add_generation_prompt=True
        )
        for p in prompts
    ]


def prompt_lengths(
    tokenizer, cfg: DataConfig, prompts: list[str], chunk: int = 1024, tools: list[dict[str, Any]] | None = None
) -> list[int]:
    """Each prompt's length in tokens as the rollout encodes it (``prompt_texts``, untruncated)."""
    lengths: list[int] = []
    for i in range(0, len(prompts), chunk):
        texts = prompt_texts(tokenizer, cfg, prompts[i : i + chunk], tools)
        ids = tokenizer(
            texts, add_special_tokens=not cfg.apply_chat_template, return_attention_mask=False, verbose=False
        )["input_ids"]
        lengths.extend(len(x) for x in ids)
    return lengths


def drop_overlong(
    rows: list[dict[str, Any]], tokenizer, cfg: DataConfig, key: str, source: str, tools=None
) -> tuple[list[dict[str, Any]], Filtered]:
    """The rows whose prompt (with the ``tools``' schemas) fits in ``data.max_prompt_length`` tokens, in
    their order, and the count of the others; an InputError naming ``key``, ``source`` and the limit when
    none fits."""
    lengths = prompt_lengths(tokenizer, cfg, [row[cfg.prompt_key] for row in rows], tools=tools)
    limit = cfg.max_prompt_length
    kept = [row for row, n in zip(rows, lengths) if n <= limit]
    if not kept:
        raise InputError(
            f"every prompt of '{key}' {source} is longer than 'data.max_prompt_length' ({limit} tokens; the "
            f"shortest has {min(lengths)}), so 'data.filter_overlong_prompts' leaves none: raise the limit"
        )
    return kept, Filtered(key, source, len(rows), len(rows) - len(kept), limit, max(lengths))


def check_prompt_template(cfg: RunConfig) -> None:
    """``check_chat_template`` before any work (the preflight): the built-in model's tokenizer (its chars one has no
    chat template), or the tokenizer of ``model.path``; the trainer checks the tokenizer it loads again."""
    if not cfg.data.apply_chat_template:
        return
    check_chat_template(config_tokenizer(cfg), cfg.data, model_name(cfg))


def config_tokenizer(cfg: RunConfig):
    """The tokenizer the run will load (the built-in model's, or that of ``model.path``), for the
    preflight's checks; no weights are read."""
    from rlctl.engine.model import build_builtin_tokenizer, load_tokenizer

    if cfg.model.path is None:
        return build_builtin_tokenizer(cfg.model.builtin)
    return load_tokenizer(Path(cfg.model.path).expanduser(), cfg.model.trust_remote_code)


def model_name(cfg: RunConfig) -> str:
    """The model as an error names it."""
    return "the built-in model" if cfg.model.path is None else cfg.model.path


def check_chat_template(tokenizer, cfg: DataConfig, model: str) -> None:
    """A ConfigError when the config asks for the chat template (``data.apply_chat_template``, or
    ``data.system_prompt``) and the tokenizer of ``model`` has none, or its template fails on the
    conversation a prompt becomes."""
    if not cfg.apply_chat_template:
        return
    key = "data.system_prompt" if cfg.system_prompt is not None else "data.apply_chat_template"
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            f"'{key}' needs a chat template, but the tokenizer of {model} has none (no chat_template in its "
            f"tokenizer files); use a model with one, or leave '{key}' unset"
        )
    try:
        prompt_texts(tokenizer, cfg, ["?"])
    except Exception as exc:  # a template is user code: jinja2 and its raise_exception() raise anything
        roles = "+".join(m["role"] for m in prompt_messages(cfg, "?"))
        detail = " ".join(str(exc).split())[:300]
        raise ConfigError(f"'{key}': the chat template of {model} fails on a {roles} conversation: {detail}") from None


def columns_of(rows: list[dict[str, Any]], prompt_key: str) -> dict[str, list]:
    """The rows' columns other than the prompt, aligned with them (what the reward function receives): every
    column any row has (a JSONL file's rows may differ), None where a row lacks it."""
    names = dict.fromkeys(c for r in rows for c in r)
    return {c: [r.get(c) for r in rows] for c in names if c != prompt_key}


TRAIN_SPLITS = ("train",)  # the split of a DatasetDict directory that training takes
VAL_SPLITS = ("validation", "test")  # and validation, the first there is: never train


def read_prompt_file(
    path: Path, prompt_key: str, key: str, splits: tuple[str, ...] = TRAIN_SPLITS
) -> list[dict[str, Any]]:
    """Rows of a JSONL or parquet file, or of a `datasets` directory (save_to_disk; of a DatasetDict, the
    first of ``splits`` it has); an InputError naming ``key``, the file and the line for anything that is
    not a row with a string prompt."""
    if path.is_dir():
        rows = _read_dataset_dir(path, key, splits)
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow's errors for a bad file vary
            raise InputError(f"'{key}' {path} is not a readable parquet file: {exc}") from None
    else:
        rows = _read_jsonl(path, key)
    if not rows:
        raise InputError(f"'{key}' {path} holds no rows")
    missing = [i for i, row in enumerate(rows) if not isinstance(row.get(prompt_key), str)]
    if missing and isinstance(rows[missing[0]].get(prompt_key), list):
        raise InputError(
            f"'{key}' {path}: row {missing[0] + 1}'s '{prompt_key}' is a list of messages, which rlctl does not "
            "read; give the user's text as a string (with 'data.apply_chat_template') and a system message as "
            "'data.system_prompt'"
        )
    if missing:
        raise InputError(
            f"'{key}' {path}: row {missing[0] + 1} has no string column '{prompt_key}' "
            f"(set 'data.prompt_key'; columns seen: {', '.join(sorted(rows[missing[0]]))})"
        )
    return rows


def _read_jsonl(path: Path, key: str) -> list[dict[str, Any]]:
    rows = []
    with path.open("rb") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = orjson.loads(line)
            except orjson.JSONDecodeError as exc:
                raise InputError(f"'{key}' {path} line {lineno} is not valid JSON: {exc}") from None
            if not isinstance(row, dict):
                raise InputError(f"'{key}' {path} line {lineno} is not a JSON object")
            rows.append(row)
    return rows


def _read_dataset_dir(path: Path, key: str, splits: tuple[str, ...]) -> list[dict[str, Any]]:
    """The rows of a `datasets` directory written by ``save_to_disk``, read with pyarrow alone: its
    state.json names the Arrow stream files. A DatasetDict's directory gives the first of ``splits`` it
    has (an InputError listing its splits when it has none of them)."""
    import pyarrow as pa

    if (path / "dataset_dict.json").is_file():
        path = path / _split_of(path, key, splits)
    try:
        state = orjson.loads((path / "state.json").read_bytes())
        tables = []
        for entry in state["_data_files"]:
            data = (path / entry["filename"]).read_bytes()
            tables.append(pa.ipc.open_stream(pa.BufferReader(data)).read_all())
    except (OSError, KeyError, IndexError, TypeError, orjson.JSONDecodeError, pa.ArrowInvalid) as exc:
        raise InputError(f"'{key}' {path} is not a readable `datasets` directory (save_to_disk): {exc}") from None
    return pa.concat_tables(tables).to_pylist() if tables else []


def _split_of(path: Path, key: str, wanted: tuple[str, ...]) -> str:
    try:
        splits = orjson.loads((path / "dataset_dict.json").read_bytes())["splits"]
    except (OSError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
        raise InputError(f"'{key}' {path} is not a readable `datasets` directory (save_to_disk): {exc}") from None
    found = next((s for s in wanted if s in splits), None)
    if found is None:
        raise InputError(
            f"'{key}' {path} holds the splits {', '.join(map(str, splits))}, none of {', '.join(wanted)}; "
            "point it at the split's own directory"
        )
    return found


def rows_digest(rows: list[dict[str, Any]]) -> str:
    """A hash of the rows in order (keys sorted): equal digests mean the cursor indexes the same prompts."""
    h = hashlib.blake2b(digest_size=16)
    for row in rows:
        h.update(orjson.dumps(row, option=orjson.OPT_SORT_KEYS | orjson.OPT_SERIALIZE_NUMPY, default=str))
        h.update(b"\n")
    return h.hexdigest()


class PromptCursor:
    """Draws batches of (row index, row) in a seeded order, epoch after epoch. Stateful."""

    VERSION = 1

    def __init__(self, rows: list[dict[str, Any]], seed: int, shuffle: bool = True):
        self.rows = rows
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order = self._permutation(0)
        self.exclude: set[int] = set()  # owned by the policy guard, not part of this state
        self.digest = rows_digest(rows)

    def _permutation(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.rows))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.rows))

    def next_batch(self, n: int) -> list[tuple[int, dict[str, Any]]]:
        """The next ``n`` rows, passing over the indices in ``exclude`` (prompts a policy skipped)."""
        out = []
        passed = 0
        while len(out) < n:
            if self.position >= len(self._order):
                self.epoch += 1
                self.position = 0
                self._order = self._permutation(self.epoch)
            idx = int(self._order[self.position])
            self.position += 1
            if idx in self.exclude:
                passed += 1
                if passed > len(self.rows):
                    raise InputError("every prompt of the dataset has been skipped by a rollback policy")
                continue
            out.append((idx, self.rows[idx]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": self.VERSION,
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
            "rows_digest": self.digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("data cursor", state, self.VERSION)
        if state["num_rows"] != len(self.rows):
            raise InputError(
                f"the dataset now has {len(self.rows)} rows but the snapshot was taken with "
                f"{state['num_rows']}; resume with the same 'data.path' (and the same prompts "
                "'data.filter_overlong_prompts' keeps)"
            )
        if state.get("rows_digest", self.digest) != self.digest:  # (snapshots before it have none)
            raise InputError(
                f"the dataset's {len(self.rows)} prompts are not the ones the snapshot was taken with (as many, "
                "but other rows or another order): resume with the same 'data.path', and the same tokenizer and "
                "'data.max_prompt_length' when 'data.filter_overlong_prompts' chooses the rows"
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
