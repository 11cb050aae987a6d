"""A whole run on fsspec's memory filesystem, in this process: run directory, snapshots, resume."""

import uuid

import pytest

from rlctl.config import load_config
from rlctl.metrics import read_rows
from rlctl.run import resume_run, start_run
from rlctl.storage import Storage

pytestmark = pytest.mark.slow  # (a whole run in this process: `make test` runs it, test-fast does not)


def test_start_and_resume_on_memory_storage(runtime):
    url = f"memory://runs-{uuid.uuid4().hex}/r"
    cfg = load_config(
        None,
        [
            "trainer.total_steps=4",
            "checkpoint.every=2",
            "trainer.prompts_per_step=2",
            "algorithm.group_size=2",
            "rollout.max_new_tokens=4",
        ],
    )
    summary = start_run(cfg, url)
    assert summary["steps"] == 4 and summary["run_dir"] == url
    run = Storage(url)
    assert run.listdir("checkpoints") == ["step-000002", "step-000004"]
    assert run.exists("model", "config.json") and not run.exists("lease.json")

    resume_run(url, "step-2")
    events = read_rows(run, "events.jsonl")
    done = [e["weights_sha256"] for e in events if e["event"] == "completed"]
    assert len(done) == 2 and done[0] == done[1]
    assert [r["step"] for r in read_rows(run, "metrics.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in read_rows(run, "metrics.abandoned.jsonl")] == [3, 4]
    assert run.listdir("checkpoints", "abandoned") and run.listdir("checkpoints")[-1] == "step-000004"
