"""The snapshot writer process imports what its jobs need as it starts, before any job (so the first
snapshot does not wait for torch and DeepSpeed), in the environment it was started with; ``stop`` ends it
at once, even in the middle of those imports. A real writer process."""

import os
import time

import pytest

from rlctl.checkpoint.writer import WriterProcess

MARKER = """
import os, sys
def note():
    with open(os.environ["PRELOAD_NOTE"], "a") as fh:
        fh.write(f"called torch={'torch.multiprocessing.reductions' in sys.modules}\\n")
with open(os.environ["PRELOAD_NOTE"], "a") as fh:
    fh.write(f"imported accelerator={os.environ.get('DS_ACCELERATOR')}\\n")
"""


@pytest.mark.slow
def test_the_writer_imports_torch_and_its_preload_before_any_job(tmp_path, monkeypatch):
    (tmp_path / "preload_marker.py").write_text(MARKER)
    monkeypatch.syspath_prepend(str(tmp_path))  # the writer imports from where this process does
    note = tmp_path / "note.txt"
    writer = WriterProcess()
    writer.start(["preload_marker", "preload_marker:note"], env={"PRELOAD_NOTE": str(note), "DS_ACCELERATOR": "cpu"})
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(note.read_text().splitlines() if note.exists() else []) < 2:
            time.sleep(0.05)
        assert note.read_text().splitlines() == ["imported accelerator=cpu", "called torch=True"]
        assert writer.alive()  # and waiting for its first job
    finally:
        writer.stop()
    assert not writer.alive()


def test_stop_ends_a_writer_in_the_middle_of_its_imports(tmp_path, monkeypatch):
    """A run turned away before it trains stops its early writer at once, whatever it is importing."""
    (tmp_path / "slow_import.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    writer = WriterProcess()
    writer.start(["slow_import"])
    pid = writer.pid
    time.sleep(0.5)
    t0 = time.time()
    writer.stop()
    assert time.time() - t0 < 5 and not writer.alive() and not os.path.exists(f"/proc/{pid}")


@pytest.mark.slow
def test_the_writers_deepspeed_reads_engine_state_without_torch_dynamo():
    """The writer's preload (``WRITER_PRELOAD``) imports DeepSpeed without its Muon module, and what a ZeRO
    optimizer's state dict holds (a loss scaler, the stage enum, tensor fragments) still unpickles there,
    importing neither Muon nor torch._dynamo (each writer start saves about 1.5 s of CPU)."""
    import pickle
    import subprocess
    import sys

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    from rlctl.ranks.worker import WRITER_ENV, WRITER_PRELOAD

    state = {"loss_scaler": DynamicLossScaler(2.0**16, 1000, 1.0, 2, False), "zero_stage": ZeroStageEnum(2)}
    state["frag"] = fragment_address(numel=4, start=0)
    module, _, function = WRITER_PRELOAD[0].partition(":")
    code = (
        "import importlib, pickle, sys\n"
        f"getattr(importlib.import_module({module!r}), {function!r})()\n"
        "state = pickle.loads(sys.stdin.buffer.read())\n"
        "from rlctl.engine.runtime import MUON\n"
        "assert state['zero_stage'] == 2 and state['loss_scaler'].cur_scale == 2.0**16, state\n"
        "assert MUON not in sys.modules and 'torch._dynamo' not in sys.modules, 'Muon or dynamo imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], input=pickle.dumps(state), capture_output=True, env={**os.environ, **WRITER_ENV}
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]


FORK_OR_EXEC = """
import os, sys, threading, time
from rlctl.checkpoint.writer import WriterProcess

def seen(pid):  # (its command line, and its name once it gave itself one)
    for _ in range(1200):
        with open(f"/proc/{pid}/comm") as fh:
            if fh.read().strip() == "rlctl-writer":
                break
        time.sleep(0.05)
    with open(f"/proc/{pid}/cmdline", "rb") as fh, open(f"/proc/{pid}/comm") as comm:
        cmdline = fh.read()
        return cmdline == ours or cmdline.split(b"\\0")[1:3], comm.read().strip()

with open(f"/proc/{os.getpid()}/cmdline", "rb") as fh:
    ours = fh.read()
import torch  # (a forked writer has it already)
sys.stderr.write("pending, no newline yet")  # (held in stderr's buffer: the forked child must not write it too)
found = {}
for case in ("one thread", "two threads", "not allowed"):
    other = threading.Thread(target=time.sleep, args=(60,), daemon=True) if case == "two threads" else None
    if other:
        other.start()
    writer = WriterProcess()
    writer.start(fork=case != "not allowed")
    found[case] = seen(writer.pid)
    writer.close()  # (EOF: it returns from its loop and exits as at a run's end, flushing its stderr)
    assert not writer.alive()
print(found)
"""


@pytest.mark.slow
def test_a_writer_is_forked_only_from_a_process_of_one_thread_that_allows_it():
    """``start(fork=True)`` in a process of one thread forks the writer (it has this process's command
    line); with a second thread running, or without ``fork``, it is a new interpreter (``python -m
    rlctl.checkpoint.writer``). Either way it names itself rlctl-writer, and ``close`` ends it. What this
    process's stderr held unwritten at the fork is written once, not by the child too."""
    import ast
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # (stderr line-buffered, as by default)
    done = subprocess.run([sys.executable, "-c", FORK_OR_EXEC], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    found = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert found["one thread"] == (True, "rlctl-writer"), found
    assert found["two threads"] == ([b"-m", b"rlctl.checkpoint.writer"], "rlctl-writer"), found
    assert found["not allowed"] == ([b"-m", b"rlctl.checkpoint.writer"], "rlctl-writer"), found
    assert done.stderr.count("pending, no newline yet") == 1, done.stderr  # (once: not again by the child)


@pytest.mark.slow
def test_a_writer_at_rest_serves_the_next_run_of_its_environment_and_another_gets_its_own(tmp_path, monkeypatch):
    """Runs trained one after another in one process (`start_run` called again, as the suite and a sweep do)
    share one writer process: put to rest at a run's end (``rest``), it frees its staging buffers and
    serves the next run's snapshots without a new interpreter's imports, whatever preload the next run
    asks for; started again in another environment (here a variable set between the runs), it is
    replaced by a writer that has it."""
    import torch

    from rlctl.checkpoint.handover import pickle_job
    from rlctl.checkpoint.job import WriteJob
    from rlctl.storage import Storage

    writer = WriterProcess()
    try:
        writer.start()
        first = writer.pid
        for step in (1, 2):  # a job, a rest, a job: the same process serves both
            stage = tmp_path / f"step-{step}"
            stage.mkdir()
            deferred = [(str(stage / "t.pt"), {"t": torch.full((64,), float(step))})]
            job = WriteJob(f"step-{step}", str(stage), Storage(str(tmp_path / "store")), deferred=deferred)
            assert writer.run(pickle_job(job), stage_copy=True, staged=lambda: None) is not None
            assert torch.load(stage / "t.pt")["t"][0].item() == step
            writer.rest()
            writer.start()
            assert writer.pid == first and writer.alive()
        writer.start(["json"])  # another preload is no other environment: a job imports what it names
        assert writer.pid == first and writer.alive()
        monkeypatch.setenv("RLCTL_TEST_WRITER_ENV", "another")
        writer.start()
        assert writer.alive() and writer.pid != first and not os.path.exists(f"/proc/{first}/cmdline")
    finally:
        writer.stop()


def test_only_a_run_whose_state_names_deepspeed_has_its_writer_import_deepspeed():
    """A fresh world of one trains at ZeRO stage 0: its state dicts name only torch's classes, so its
    writer starts without DeepSpeed (about 1 s of CPU for a writer that cannot be forked). Two ranks
    (partitioned) and fp16 (a loss scaler) keep the preload; PPO's critic counts as the actor does."""
    from rlctl.config import validate_config
    from rlctl.ranks.worker import WRITER_PRELOAD, _writer_preload

    def preload(nproc=1, stage=2, dtype="auto", algorithm="grpo", critic=2):
        data = {"trainer": {"nproc": nproc}, "actor": {"zero_stage": stage}, "model": {"dtype": dtype}}
        data |= {"algorithm": {"name": algorithm}, "critic": {"zero_stage": critic}}
        return _writer_preload(validate_config(data))

    assert preload() == () and preload(stage=1, dtype="bf16") == () and preload(algorithm="ppo") == ()
    assert preload(nproc=2) == WRITER_PRELOAD and preload(nproc=2, stage=0) == ()
    assert preload(dtype="fp16") == WRITER_PRELOAD
    assert preload(stage=3) == WRITER_PRELOAD  # (ZeRO-3 is never trained at stage 0)
    assert preload(stage=0, algorithm="ppo", critic=3) == WRITER_PRELOAD
