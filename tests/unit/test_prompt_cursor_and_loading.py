import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlctl.config import DataConfig
from rlctl.engine.data import PromptCursor, load_rows
from rlctl.errors import InputError


def test_cursor_round_trip_continues_identically():
    rows = [{"prompt": str(i)} for i in range(7)]
    a = PromptCursor(rows, seed=3)
    a.next_batch(5)
    state = a.state_dict()
    expected = [i for i, _ in a.next_batch(12)]  # crosses two epoch boundaries
    b = PromptCursor(rows, seed=3)
    b.load_state_dict(state)
    assert [i for i, _ in b.next_batch(12)] == expected


def test_cursor_epochs_are_permutations_and_differ():
    rows = [{"prompt": str(i)} for i in range(10)]
    c = PromptCursor(rows, seed=0)
    e0 = [i for i, _ in c.next_batch(10)]
    e1 = [i for i, _ in c.next_batch(10)]
    assert sorted(e0) == sorted(e1) == list(range(10))
    assert e0 != e1 and c.epoch == 1


def test_cursor_refuses_other_dataset_and_version():
    state = PromptCursor([{"prompt": "a"}] * 3, seed=0).state_dict()
    with pytest.raises(InputError, match="now has 4 rows but the snapshot was taken with 3"):
        PromptCursor([{"prompt": "a"}] * 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="version 99"):
        PromptCursor([{"prompt": "a"}] * 3, seed=0).load_state_dict({**state, "version": 99})


def test_load_jsonl_and_parquet(tmp_path):
    rows = [{"question": "1+1?", "answer": "2"}, {"question": "2+2?", "answer": "4"}]
    jl = tmp_path / "d.jsonl"
    jl.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    pqf = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(rows), pqf)
    for path in (jl, pqf):
        assert load_rows(DataConfig(path=str(path), prompt_key="question"), seed=0) == rows


def test_load_errors_name_line_and_column(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(InputError, match="line 2 is not valid JSON"):
        load_rows(DataConfig(path=str(bad)), seed=0)
    nokey = tmp_path / "nokey.jsonl"
    nokey.write_text('{"question": "x"}\n')
    with pytest.raises(InputError, match="no string column 'prompt'.*columns seen: question"):
        load_rows(DataConfig(path=str(nokey)), seed=0)
