"""What the tests share: running the installed CLI in a subprocess, reading a run's rows and events,
waiting for a run to reach a step, reading trackers back with their own readers. (Fixtures live in
conftest.py.)"""

import contextlib
import glob
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import forkserver

REPO = Path(__file__).resolve().parents[2]
RLCTL = [str(Path(sys.executable).parent / "rlctl")]  # the installed console script

DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def child_env(**extra: str) -> dict[str, str]:
    """This environment without the distributed variables an in-process test may have set (a child
    would inherit a MASTER_PORT this process already holds)."""
    return {**{k: v for k, v in os.environ.items() if k not in DIST_VARS}, **extra}


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 600, env=None, faults: str = ""
) -> subprocess.CompletedProcess:
    """`rlctl ARGS` in a process of its own, as ``spawn`` starts it, run to its end (``timeout``: killed
    then, and TimeoutExpired raised). ``invoke`` runs it in this process."""
    proc = spawn(*args, faults=faults, env=env, cwd=cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return subprocess.CompletedProcess([*RLCTL, *args], proc.returncode, out, err)


def _popen(args, env: dict[str, str], cwd: Path, fork: bool = True):
    """`rlctl ARGS` in a process of its own with text pipes: forked by the tests' fork server (the same
    process without the cost of its imports, see ``forkserver``) where ``env`` allows, else (or with
    ``fork=False``) the installed console script."""
    if fork and forkserver.enabled():
        server = forkserver.ForkServer.get(child_env(), REPO)
        if server.forkable(env):
            return server.spawn(list(args), env, cwd)
    return subprocess.Popen(
        [*RLCTL, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )


def invoke(*args: str, env=None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """The entry point (``rlctl.cli:main``: exit codes, one-sentence errors) run in this process, in ``cwd``
    (this process's own by default): what ``run_cli`` gives, without the start of a new interpreter and
    its imports (about 5 s of CPU): read-only commands, refusals, exports, and starts and resumes the
    same row for row and byte for byte (the resume tests compare such runs with resumed ones made in
    processes of their own). A run that is killed, signalled, crashed or held (``sleep``, ``crash``) or
    has ranks of its own needs a process (``run_cli``, ``spawn``); drills that act on the data go in the
    run's config here (``drills``), since RLCTL_FAULTS would fire once per process."""
    from click.testing import CliRunner

    from rlctl import faults
    from rlctl.cli import main

    # (without pytest's per-test variable: a run here keeps the snapshot writer that an earlier test's run
    # put to rest, as one process's runs do, rather than start one per test)
    env = {"PYTEST_CURRENT_TEST": None, **(env or {})}
    with contextlib.chdir(cwd or os.getcwd()), CliRunner().isolation(env=env) as (out, err, _):
        try:
            main(list(args))
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        finally:
            faults.configure(None)  # a run's drills stay armed in this process: disarmed for the next test
    return subprocess.CompletedProcess(["rlctl", *args], code, out.getvalue().decode(), err.getvalue().decode())


def start_args(run_dir, config=None, steps: int | None = None, every: int | None = None) -> list[str]:
    """The arguments of ``rlctl start`` after its name: ``[CONFIG] --run-dir RUN_DIR``, ``config`` a path
    or a dict (written as JSON beside the run directory); ``steps``, ``every``: trainer.total_steps and
    checkpoint.every. ``run_cli("start", *start_args(run, steps=4))``, and so with ``spawn`` and ``invoke``."""
    if isinstance(config, dict):
        path = Path(run_dir).with_name(Path(run_dir).name + ".yaml")
        path.write_text(json.dumps(config))
        config = path
    out = [str(config)] if config is not None else []
    out += ["--run-dir", str(run_dir)]
    if steps is not None:
        out += ["--set", f"trainer.total_steps={steps}"]
    if every is not None:
        out += ["--set", f"checkpoint.every={every}"]
    return out


def metrics_of(run_dir, rel: str = "metrics.jsonl") -> list[dict]:
    from rlctl.metrics import read_rows
    from rlctl.storage import Storage

    return read_rows(Storage(str(run_dir)), rel)


SMALL = ["--set", "trainer.prompts_per_step=4", "--set", "algorithm.group_size=4", "--set", "rollout.max_new_tokens=6"]
VOLATILE = ("timing_s/", "perf/throughput", "timestamp")


def stable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE) and k != "abandoned"} for r in rows]


def events_of(run_dir, kind: str | None = None) -> list[dict]:
    """The run's events, oldest first; only those named ``kind`` if given."""
    events = metrics_of(run_dir, "events.jsonl")
    return events if kind is None else [e for e in events if e["event"] == kind]


def kinds(run_dir) -> list[str]:
    """The names of the run's events, oldest first ([] before events.jsonl exists)."""
    return [e["event"] for e in events_of(run_dir)]


def completed_hash(run_dir):
    return [e for e in events_of(run_dir) if e["event"] == "completed"][-1]["weights_sha256"]


def spawn(*args, faults="", env=None, cwd=None, fork: bool = True):
    """`rlctl ARGS` left running in a process of its own (a Popen with text pipes; ``_popen``): ``env``
    added to this process's environment (``child_env``), ``faults`` as RLCTL_FAULTS (drills that fire
    once per process; else ``env``'s, never this process's own), in ``cwd`` (the repository's root by
    default); ``fork=False``: a new interpreter from the console script, never the fork server's child."""
    extra = {"RLCTL_FAULTS": "", **(env or {}), **({"RLCTL_FAULTS": faults} if faults else {})}
    return _popen(args, env=child_env(**extra), cwd=cwd or REPO, fork=fork)


def drills(faults: str) -> list[str]:
    """``faults`` armed in a run's config (``--set faults=...``: each fires once per run), for ``invoke``."""
    return ["--set", f"faults={faults}"] if faults else []


def wait_for(predicate, proc, timeout=300):
    """Poll ``predicate`` until it holds; an AssertionError (``proc`` killed) if ``proc`` ends first or
    ``timeout`` passes. The timeout is generous: a Ray run on a loaded 2-core CI machine took over 120 s
    to reach its third step."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("timed out waiting")


def has_step(run_dir, step):
    return lambda: (run_dir / "metrics.jsonl").exists() and any(r["step"] >= step for r in metrics_of(run_dir))


def settled_before(run_dir, step) -> bool:
    """Every snapshot of a step before ``step`` is committed: the sleep drill of ``step`` has begun (it
    waits for them; the step's metric row comes before, while an earlier snapshot may be in flight)."""
    found = (run_dir / "checkpoints").glob("step-*")
    return all((d / "manifest.json").exists() for d in found if d.name[5:].isdigit() and int(d.name[5:]) < step)


def kill_and_resume(run_dir, args, step) -> subprocess.CompletedProcess:
    """Start a run into ``run_dir`` with ``args``, SIGKILL it while it sleeps after ``step``, then resume it
    from its latest snapshot; the finished resume (asserted to exit 0)."""
    import signal

    proc = spawn("start", "--run-dir", str(run_dir), *args, faults=f"sleep@{step}=120")
    wait_for(lambda: has_step(run_dir, step)() and settled_before(run_dir, step), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    r = run_cli("resume", str(run_dir), "--from", "latest")
    assert r.returncode == 0, r.stderr
    return r


def assert_steps_run_again_alike(run_dir, steps: list[int]) -> None:
    """After a completed run was resumed from an earlier snapshot and completed again: the steps run again
    (``steps``) wrote the rows the first run wrote (now in metrics.abandoned.jsonl), and both completions
    ended with the same weights."""
    abandoned = metrics_of(run_dir, "metrics.abandoned.jsonl")
    assert [row["step"] for row in abandoned] == steps
    assert stable(metrics_of(run_dir)[-len(steps) :]) == stable(abandoned)
    hashes = [e["weights_sha256"] for e in events_of(run_dir, "completed")]
    assert len(hashes) == 2 and hashes[0] == hashes[1]


@contextlib.contextmanager
def small_tmpfs(path, size="64k"):
    """A real small filesystem (tmpfs) mounted at ``path``, for a full disk; root only: the test is
    skipped where it cannot be mounted."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


class Number:
    """The smallest Stateful: one versioned number."""

    VERSION = 1

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"version": self.VERSION, "value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


# -- reading trackers back with their own readers -------------------------------------------------------
def tb_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path):
    """The protobuf records of a W&B transaction log (.wandb): a 7-byte header, then 32 KiB blocks of
    records (checksum, length, type), long records split FIRST/MIDDLE/LAST."""
    from wandb.proto import wandb_internal_pb2 as pb

    with open(path, "rb") as fh:
        data = fh.read()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1)
    pos, block, head, buf = 7, 32768, 7, b""
    while pos + head <= len(data):
        if block - pos % block < head:
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + head])
        chunk, pos = data[pos + head : pos + head + length], pos + head + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def wandb_run(run_dir, run_id):
    """(history {step: {key: value}}, run records, summary updates) of every offline piece of one run."""
    history, runs, summary = {}, [], {}
    for path in sorted(glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                history.setdefault(record.history.step.num, {}).update(items)
            elif kind == "run":
                runs.append(record.run)
            elif kind == "summary":
                summary |= {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in record.summary.update}
    return history, runs, summary


def wandb_ids(run_dir):
    return sorted({p.rsplit("-", 1)[1] for p in os.listdir(run_dir / "wandb") if p.startswith("offline-run-")})


def mlflow_runs(run_dir, experiment_name="demo"):
    """The MLflow client of a run directory's local store, and the runs of an experiment, oldest first."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir}/mlflow.db")
    experiment = client.get_experiment_by_name(experiment_name)
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    return client, runs


def steps_of(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def hf_weights_sha256(model_dir) -> str:
    """The hash a run's `completed` event gives its weights (every parameter's bytes, by name), of a Hugging
    Face model directory loaded with transformers' own reader (and its tokenizer loaded, to prove it is
    there); computed in this process, which saves a subprocess that imports torch and transformers."""
    import hashlib

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    AutoTokenizer.from_pretrained(str(model_dir))
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def save_reward_model(path, *, context=64, num_labels=1, head=None, padding_side="left"):
    """A tiny seeded Llama with a score head (hidden 64, 2 layers) and the built-in char tokenizer, saved
    in ``path`` (``head``: another class, e.g. a causal LM, for the errors a reward model must give)."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from rlctl.engine.model import build_char_tokenizer

    head = head or LlamaForSequenceClassification
    tok = build_char_tokenizer()
    tok.padding_side, tok.model_max_length = padding_side, context
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=context,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        num_labels=num_labels,
    )
    torch.manual_seed(0)
    model = head(cfg)
    if head is LlamaForSequenceClassification:
        torch.nn.init.normal_(model.score.weight, std=1.0)  # scores far apart enough to tell texts apart
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def writer_pids(ancestor: int) -> list[int]:
    """The snapshot writer processes below process ``ancestor`` (named rlctl-writer, forked or exec'd;
    an exec'd one by its command line before it names itself)."""
    parents, writers = {}, []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parents[int(entry)] = int(fh.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/comm", "rb") as comm, open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if comm.read() == b"rlctl-writer\n" or b"rlctl.checkpoint.writer" in cmdline.read():
                    writers.append(int(entry))
        except (OSError, IndexError, ValueError):
            continue

    def below(pid: int) -> bool:
        seen = set()
        while pid in parents and pid not in seen:
            seen.add(pid)
            pid = parents[pid]
            if pid == ancestor:
                return True
        return False

    return sorted(p for p in writers if below(p))


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
