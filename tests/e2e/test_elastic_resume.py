"""Elastic resume: runs trained on 2 local ranks (ZeRO 1, 2 and 3, and LoRA) resume on 1 or 3 (`rlctl resume
RUN --set trainer.nproc=K`) through DeepSpeed's universal checkpoint. The weights loaded are bit-identical to the
2-rank snapshot's (their sha256, against DeepSpeed's own zero_to_fp32 reader); the resumed step draws the
same prompts (the data cursor and counters of its snapshot equal the uninterrupted run's) and samples the
same tokens; its weights and Adam moments equal the uninterrupted 2-rank run's within TOLERANCE (the
gradient is all-reduced over another number of ranks: float rounding only). A 1-rank run, which trains its
configured ZeRO-2 at stage 0, resumes onto 2 ranks at ZeRO-2 the same way (``rlctl.engine.stage0`` loads
its snapshot); a 1-rank resume of a ZeRO-2 snapshot keeps stage 2. A change of ZeRO stage, and a snapshot
of another world size in a run whose snapshots hold batches generated ahead, are refused."""

import glob
import os
import shutil

import pytest
import torch

from rlctl.errors import ExitCode

from helpers import events_of, invoke, metrics_of, run_cli, start_args

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("two_ranks", "one_rank")

# 6 prompts: a share for each of 1, 2 and 3 ranks; a snapshot after each of the 2 steps, both kept
ARGS = [
    *("--set", "trainer.prompts_per_step=6", "--set", "algorithm.group_size=4"),
    *("--set", "rollout.max_new_tokens=6"),
    *("--set", "trainer.total_steps=2", "--set", "checkpoint.every=1", "--set", "checkpoint.keep_last=5"),
]
# the runs resumed: ZeRO 1, 2 and 3, and a LoRA run (ZeRO-2), each on 2 ranks
RUNS = {
    "zero1": ["--set", "actor.zero_stage=1"],
    "zero2": ["--set", "actor.zero_stage=2"],
    "zero3": ["--set", "actor.zero_stage=3"],
    "lora": ["--set", "actor.zero_stage=2", "--set", "actor.lora.rank=4", "--set", "actor.lora.alpha=8"],
}
# the resumed step's weights and Adam moments against the uninterrupted run's, per tensor: within this
# fraction of the tensor's largest magnitude (measured: at most 1.2e-6 on 3 ranks, 3e-7 on 1)
TOLERANCE = 1e-5
# what the resumed step's row must equal exactly (the same prompts, the same samples) and within rounding
SAME = (
    "step",
    "perf/tokens_seen",
    "response_length/max",
    "response_length/min",
    "critic/score/max",
    "critic/score/min",
)
CLOSE = (
    "response_length/mean",
    "critic/score/mean",
    "actor/pg_loss",
    "actor/entropy",
    "actor/grad_norm",
    "rollout/logprob_diff",
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, request):
    """The uninterrupted 2-rank run of ``RUNS[request.param]`` (about 10 s here), and the sha256 of its
    step-1 weights as DeepSpeed's zero_to_fp32 reads them from the snapshot's two partitions."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from rlctl.engine.ds_module import weights_digest

    run = tmp_path_factory.mktemp(f"elastic-{request.param}") / "two"
    r = run_cli("start", *start_args(run), "--nproc", "2", *ARGS, *RUNS[request.param])
    assert r.returncode == 0, r.stderr
    weights = get_fp32_state_dict_from_zero_checkpoint(str(step_dir(run, 1)), tag="actor")
    if request.param == "lora":  # what rlctl hashes of a LoRA actor: its weights with the adapter merged
        from rlctl.engine.lora import merged_weights
        from rlctl.export import _lora_model
        from rlctl.rundir.directory import load_run_config
        from rlctl.storage import Storage

        storage = Storage(str(run))
        return run, weights_digest(merged_weights(_lora_model(load_run_config(storage), storage, weights, "step-1")))
    return run, weights_digest(weights.items())


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """The uninterrupted 1-rank run of ``RUNS["zero2"]`` (trained at stage 0), and the sha256 of its
    step-1 weights as its snapshot's model states file holds them."""
    from rlctl.engine.ds_module import stage0_fp32_state_dict, weights_digest

    run = tmp_path_factory.mktemp("elastic-one") / "one"
    r = run_cli("start", *start_args(run), *ARGS, *RUNS["zero2"])
    assert r.returncode == 0, r.stderr
    assert manifest_of(run, 1)["zero_stage"] == 0
    actor = step_dir(run, 1) / "actor"
    weights = stage0_fp32_state_dict(str(actor))
    names = parameter_names(torch.load(actor / "mp_rank_00_model_states.pt", weights_only=False))
    return run, weights_digest((name, weights[name]) for name in names)


def parameter_names(saved) -> list[str]:
    """The names of the parameters of a stage-0 checkpoint's model states ``saved``, in the module's order
    (the order of its optimizer's state), a tied one once (as ``named_parameters`` gives them)."""
    module, buffers = saved["module"], set(saved["buffer_names"])
    first = {}
    for name, tensor in module.items():
        if name not in buffers:
            first.setdefault(tensor.data_ptr(), name)
    return list(first.values())


def step_dir(run, step):
    return run / "checkpoints" / f"step-{step:06d}"


def engine_state(run, step, tmp):
    """The actor's state in a snapshot, whatever its world size: {(param, fp32|exp_avg|exp_avg_sq|step):
    tensor}, and the lr schedule, read from the universal checkpoint DeepSpeed makes of it (a stage-0
    snapshot's from its model states file)."""
    from rlctl.engine.universal import saved_partitions, to_universal

    if saved_partitions(str(step_dir(run, step) / "actor")) is None:
        return stage0_engine_state(step_dir(run, step) / "actor")

    out = tmp / f"universal-{run.name}-{step}" / "actor"
    to_universal(str(step_dir(run, step) / "actor"), str(out))
    state = {}
    for path in glob.glob(str(out / "zero" / "*" / "*.pt")):
        param, key = os.path.basename(os.path.dirname(path)), os.path.basename(path)[:-3]
        saved = torch.load(path, weights_only=False)
        state[(param, key)] = (saved["param"] if isinstance(saved, dict) else saved).detach()  # (step.pt: Adam's step)
    states = sorted((step_dir(run, step) / "actor").glob("*mp_rank_00_model_states.pt"))  # (ZeRO-3: per rank)
    model_states = torch.load(states[0], weights_only=False)
    return state, model_states["lr_scheduler"]


def stage0_engine_state(actor):
    """``engine_state`` of a stage-0 (fp32) snapshot's actor directory: its module's parameters are the
    masters; torch's AdamW state numbers them in the module's order."""
    saved = torch.load(actor / "mp_rank_00_model_states.pt", weights_only=False)
    names = parameter_names(saved)
    optimizer = saved["optimizer"]["state"]
    state = {}
    for i, name in enumerate(names):
        state[(name, "fp32")] = saved["module"][name].detach()
        for key in ("exp_avg", "exp_avg_sq", "step"):
            state[(name, key)] = optimizer[i][key].detach()
    return state, saved["lr_scheduler"]


def close_to(mine, theirs):
    """Weights and Adam moments within TOLERANCE, the optimizer's step exactly (2)."""
    assert mine.keys() == theirs.keys() and len(mine) > 20
    for key, want in theirs.items():
        got = mine[key]
        if key[1] == "step":
            assert got == want == 2, key
            continue
        bound = TOLERANCE * float(want.abs().max()) + 1e-12
        assert float((got - want).abs().max()) <= bound, key


@pytest.mark.parametrize(
    ("two_ranks", "ranks"),
    [("zero2", 1), ("zero2", 3), ("zero1", 3), ("zero3", 1), ("zero3", 3), ("lora", 1)],
    indirect=["two_ranks"],
)
def test_a_two_rank_run_resumes_on_another_number_of_ranks(two_ranks, tmp_path, ranks):
    two, loaded_sha = two_ranks
    run = tmp_path / "resumed"
    shutil.copytree(two, run)
    args = ("resume", str(run), "--from", "step-1", "--set", f"trainer.nproc={ranks}")
    r = invoke(*args) if ranks == 1 else run_cli(*args)  # (one rank trains in this process)
    assert r.returncode == 0, r.stderr
    assert f"step-000001 was written by 2 rank(s); it loads on {ranks}: an elastic resume" in r.stderr

    resume = events_of(run, "resume")[-1]
    assert resume["ranks"] == {"from": 2, "to": ranks}
    assert resume["weights_sha256"] == loaded_sha  # the load is exact
    assert resume["changes"] == {"trainer.nproc": {"from": 2, "to": ranks}} and not resume["replays_exactly"]

    same_step(run, two)
    assert manifest_of(run, 2)["world_size"] == ranks
    # a snapshot of the configured stage keeps it, on one rank too (a run begun at stage 2 goes on at 2)
    assert manifest_of(run, 2)["zero_stage"] == manifest_of(two, 2)["zero_stage"] != 0

    # weights and Adam moments within TOLERANCE, the optimizer's step and the lr schedule exactly
    (mine, my_lr), (theirs, their_lr) = engine_state(run, 2, tmp_path), engine_state(two, 2, tmp_path)
    assert my_lr == their_lr
    close_to(mine, theirs)


def same_step(run, uninterrupted) -> None:
    """The resumed step 2 took the same prompts in the same order and the same samples as the
    uninterrupted run's: its row (counters equal, losses close) and its snapshot's data, trainer and KL
    states."""
    mine, theirs = metrics_of(run)[-1], metrics_of(uninterrupted)[-1]
    assert {k: mine[k] for k in SAME} == {k: theirs[k] for k in SAME}
    for key in CLOSE:
        assert mine[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
    states = [torch.load(step_dir(r, 2) / "state.pt", weights_only=False) for r in (run, uninterrupted)]
    for key in ("data", "trainer", "kl_ctrl"):
        assert states[0][key] == states[1][key], key


def test_a_one_rank_run_at_stage_0_resumes_on_two_ranks_at_its_configured_stage(one_rank, tmp_path):
    """A 1-rank run configured for ZeRO-2 trains at stage 0; its snapshot loads into two ZeRO-2 ranks
    exactly (the weights' sha256), and the resumed step takes the same prompts and samples as the
    uninterrupted 1-rank run, with weights and Adam moments within TOLERANCE of its own."""
    one, loaded_sha = one_rank
    run = tmp_path / "resumed"
    shutil.copytree(one, run)
    r = run_cli("resume", str(run), "--from", "step-1", "--set", "trainer.nproc=2")
    assert r.returncode == 0, r.stderr
    assert "step-000001 was written by 1 rank(s); it loads on 2: an elastic resume" in r.stderr
    assert "trains at ZeRO stage 0" not in r.stderr  # (two ranks: the configured stage)

    resume = events_of(run, "resume")[-1]
    assert resume["ranks"] == {"from": 1, "to": 2}
    assert resume["weights_sha256"] == loaded_sha  # the load is exact
    same_step(run, one)
    m = manifest_of(run, 2)
    assert (m["world_size"], m["zero_stage"]) == (2, 2) and manifest_of(one, 2)["zero_stage"] == 0

    (mine, my_lr), (theirs, their_lr) = engine_state(run, 2, tmp_path), engine_state(one, 2, tmp_path)
    assert my_lr == their_lr
    close_to(mine, theirs)


def manifest_of(run, step) -> dict:
    import orjson

    return orjson.loads((step_dir(run, step) / "manifest.json").read_bytes())


@pytest.mark.parametrize("two_ranks", ["zero2"], indirect=True)
def test_another_zero_stage_or_world_size_is_refused_where_it_cannot_convert(two_ranks, tmp_path):
    """The ZeRO stage is no resume setting (exit 3, before any work); edited into the config, its snapshots
    are refused (exit 11). Snapshots of another world size in a run whose snapshots hold each rank's
    batches generated ahead (rollout.mode one_step_off) are not usable, and the catalog says why."""
    from rlctl.config import validate_config
    from rlctl.rundir.directory import load_run_config
    from rlctl.rundir.snapshots import snapshot_catalog
    from rlctl.storage import Storage

    two, _ = two_ranks
    run = tmp_path / "copy"
    shutil.copytree(two, run)
    r = invoke("resume", str(run), "--set", "actor.zero_stage=3")
    assert r.returncode == ExitCode.CONFIG and "'actor.zero_stage' cannot change on resume" in r.stderr
    config = run / "config.yaml"
    config.write_text(config.read_text().replace("zero_stage: 2", "zero_stage: 3"))
    r = invoke("resume", str(run), "--from", "step-1", "--set", "trainer.nproc=1")
    assert r.returncode == ExitCode.SNAPSHOT
    assert "written with ZeRO stage 2; this run uses stage 3 (the stage cannot change on resume)" in r.stderr

    cfg = load_run_config(Storage(str(two))).model_dump(mode="json")
    cfg["trainer"]["nproc"], cfg["rollout"]["mode"] = 1, "one_step_off"
    (info, _) = snapshot_catalog(Storage(str(two)), validate_config(cfg)).scan()
    assert info.problem == (
        "written by 2 rank(s); this run has 1 (a resume onto another number of ranks needs rollout.mode sync; "
        "this run's is one_step_off, whose snapshots hold each rank's share of the batches generated ahead)"
    )


@pytest.mark.parametrize("two_ranks", ["zero2"], indirect=True)
def test_an_elastic_resume_reads_its_snapshot_from_an_object_store(two_ranks, tmp_path, s3_env):
    """The 2-rank run's snapshots moved to S3 (checkpoint.dir), as ranks on several nodes keep them: the
    resume onto 1 rank fetches every old rank's partitions from the store, and loads the same weights."""
    import uuid

    import s3fs
    import yaml

    env, opts = s3_env
    two, loaded_sha = two_ranks
    run, url = tmp_path / "on-s3", f"s3://rlctl-runs/elastic-{uuid.uuid4().hex[:8]}"
    shutil.copytree(two, run)
    s3fs.S3FileSystem(**opts, skip_instance_cache=True).put(f"{run / 'checkpoints'}/", url, recursive=True)
    shutil.rmtree(run / "checkpoints")
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["checkpoint"]["dir"] = url
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    r = run_cli("resume", str(run), "--from", "step-1", "--set", "trainer.nproc=1", env=env)
    assert r.returncode == 0, r.stderr
    resume = events_of(run, "resume")[-1]
    assert resume["ranks"] == {"from": 2, "to": 1} and resume["weights_sha256"] == loaded_sha
    assert metrics_of(run)[-1]["step"] == 2 and not (run / "checkpoints").exists()
