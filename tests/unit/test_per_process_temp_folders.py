"""Each process of a run works in a temp folder of its own (rlctl.ranks.tmpdir): the folders of the run's
gone processes are removed as another enters, a live process's never."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rlctl.ranks.tmpdir import process_name, remove_gone, run_key, run_tempdir


def _gone_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_gone_processs_folder_is_removed_and_a_live_ones_kept(tmp_path):
    gone, live = tmp_path / f"{_gone_pid()}-123", tmp_path / process_name(os.getpid())
    reused = tmp_path / f"{os.getpid()}-1"  # this process's id, another start time: a process that is gone
    odd = tmp_path / "not-a-process"
    for folder in (gone, live, reused, odd):
        (folder / "pymp-x").mkdir(parents=True)
    assert remove_gone(str(tmp_path)) == sorted([gone.name, reused.name])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, odd.name])


def test_the_run_folder_is_set_for_the_block_and_restored(short_tmp, monkeypatch):
    tmp_path = short_tmp
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.delenv("RLCTL_MACHINE_TMPDIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)
    run = tmp_path / "runs" / "a"
    litter = tmp_path / run_key(str(run)) / f"{_gone_pid()}-1" / "pymp-abc"
    litter.mkdir(parents=True)
    with run_tempdir(str(run), remove_at_end=True) as own:
        assert own == str(tmp_path / run_key(str(run)) / process_name(os.getpid()))
        assert tempfile.gettempdir() == own and os.environ["TMPDIR"] == own
        assert os.environ["RLCTL_MACHINE_TMPDIR"] == str(tmp_path)  # (vLLM's cache outlives the run there)
        assert not litter.parent.exists()  # what a killed process of the run left
        assert tempfile.mkdtemp(prefix="pymp-").startswith(own + os.sep)
    assert os.environ["TMPDIR"] == str(tmp_path) and tempfile.tempdir is None
    assert not (tmp_path / run_key(str(run))).exists()  # its own folder gone, and the run's with it


def test_a_temp_directory_too_long_for_a_unix_socket_below_it_is_kept(short_tmp, monkeypatch):
    """multiprocessing's sockets live in the temp directory, and a socket's path has at most 107 bytes:
    where the run's folder would push them past that, the process keeps TMPDIR as it is."""
    tmp_path = short_tmp
    deep = tmp_path / ("d" * (107 - len(str(tmp_path)) - 40))  # (short_tmp: whatever pytest's own paths are)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr(tempfile, "tempdir", None)
    with run_tempdir(str(tmp_path / "run")) as own:
        assert own == str(deep) and tempfile.gettempdir() == str(deep)
    assert list(deep.iterdir()) == []


@pytest.fixture
def short_tmp():
    """A folder directly under /tmp: short enough for multiprocessing's sockets below a run's folder."""
    path = Path(tempfile.mkdtemp(prefix="rlctl-t-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_a_runs_key_tells_runs_apart_in_few_bytes(tmp_path):
    a, b = run_key(str(tmp_path / "x" / "run")), run_key(str(tmp_path / "y" / "run"))
    assert a.startswith("rlctl-") and len(a) == len(b) == 18 and a != b
    assert run_key("file://" + str(tmp_path / "x" / "run")) == a
    assert run_key("s3://bucket/runs/r1/") == run_key("s3://bucket/runs/r1")
