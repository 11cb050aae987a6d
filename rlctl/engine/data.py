"""Prompt datasets with a resumable cursor.

Rows are dicts with at least the prompt column; every other column is passed to the reward function.
The cursor walks a seeded permutation of the rows, reshuffled every epoch; its state is
(epoch, position, seed), so a restored run draws exactly the prompts it would have drawn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson

from rlctl.config import DataConfig
from rlctl.errors import InputError
from rlctl.stateful import check_version


def load_rows(cfg: DataConfig, seed: int) -> list[dict[str, Any]]:
    """The training prompts: ``data.path``, or the built-in task."""
    if cfg.path is None:
        from rlctl.engine.reward.builtin import make_prompts

        return make_prompts(cfg.builtin_size, seed)
    return read_prompt_file(Path(cfg.path).expanduser(), cfg.prompt_key, "data.path", TRAIN_SPLITS)


def load_val_rows(cfg: DataConfig, seed: int, training: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The held-out prompts: ``data.val_path``, or the built-in task's held-out split (prompts of its own,
    none of which is among the ``training`` rows)."""
    if cfg.val_path is not None:
        return read_prompt_file(Path(cfg.val_path).expanduser(), cfg.prompt_key, "data.val_path", VAL_SPLITS)
    from rlctl.engine.reward.builtin import make_held_out_prompts

    return make_held_out_prompts(cfg.builtin_val_size, seed, training)


def columns_of(rows: list[dict[str, Any]], prompt_key: str) -> dict[str, list]:
    """The rows' columns other than the prompt, aligned with them (what the reward function receives)."""
    return {c: [r.get(c) for r in rows] for c in rows[0] if c != prompt_key}


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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_version("data cursor", state, self.VERSION)
        if state["num_rows"] != len(self.rows):
            raise InputError(
                f"the dataset now has {len(self.rows)} rows but the snapshot was taken with "
                f"{state['num_rows']}; resume with the same 'data.path'"
            )
        self.seed, self.shuffle = state["seed"], state["shuffle"]
        self.epoch, self.position = state["epoch"], state["position"]
        self._order = self._permutation(self.epoch)
