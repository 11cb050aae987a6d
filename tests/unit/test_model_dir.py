"""The built-in model directory is never taken half-written: written into a temporary sibling and
renamed (local disk) or completed by a marker written last (object storage); a directory left
half-written by a kill (or by an rlctl that wrote no marker) is moved aside and built again."""

import hashlib
import subprocess
import sys
import textwrap

import pytest
import torch

from rlctl.config import RunConfig
from rlctl.engine.model import load_causal_lm, load_tokenizer, prepare_model_dir
from rlctl.errors import InputError
from rlctl.rundir.handle import RunDir
from rlctl.rundir.layout import MODEL_COMPLETE
from rlctl.storage import Storage

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("reference",)


def digest(model_dir) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The built-in model of seed 0, built once into its own run directory."""
    return prepare_model_dir(RunConfig(), RunDir(Storage(str(tmp_path_factory.mktemp("ref") / "run"))))


def test_a_fresh_build_is_published_whole_with_its_marker(tmp_path, reference):
    run = tmp_path / "run"
    out = prepare_model_dir(RunConfig(), RunDir(Storage(str(run))))
    assert out == run / "model" and (out / MODEL_COMPLETE).exists()
    assert digest(out) == digest(reference)  # deterministic from the seed
    assert sorted(p.name for p in run.iterdir()) == ["model"]  # no temporary left beside it
    load_causal_lm(out, dtype=torch.float32)
    assert load_tokenizer(out).eos_token == "<eos>"


def test_a_half_written_model_dir_is_moved_aside_and_rebuilt(tmp_path, reference, capsys):
    """What a SIGKILL during the old, in-place write left: config.json and nothing else."""
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_bytes((reference / "config.json").read_bytes())
    out = prepare_model_dir(RunConfig(), RunDir(Storage(str(tmp_path / "run"))))
    assert (out / MODEL_COMPLETE).exists() and digest(out) == digest(reference)
    [aside] = [p for p in (tmp_path / "run").iterdir() if p.name.startswith("model.incomplete-")]
    assert [p.name for p in aside.iterdir()] == ["config.json"]  # kept, not deleted
    err = capsys.readouterr().err
    assert f"{model} is incomplete" in err and "building the model again" in err and aside.name in err


def test_truncated_weights_are_not_taken_for_whole(tmp_path, reference):
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    for f in reference.iterdir():
        if f.name != MODEL_COMPLETE:
            (model / f.name).write_bytes(f.read_bytes())
    data = (reference / "model.safetensors").read_bytes()
    (model / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = prepare_model_dir(RunConfig(), RunDir(Storage(str(tmp_path / "run"))))
    assert digest(out) == digest(reference)


def test_a_whole_dir_without_marker_from_an_older_rlctl_is_kept(tmp_path, reference):
    model = tmp_path / "run" / "model"
    model.mkdir(parents=True)
    for f in reference.iterdir():
        if f.name != MODEL_COMPLETE:
            (model / f.name).write_bytes(f.read_bytes())
    inode = (model / "model.safetensors").stat().st_ino
    out = prepare_model_dir(RunConfig(), RunDir(Storage(str(tmp_path / "run"))))
    assert (out / MODEL_COMPLETE).exists() and (
        out / "model.safetensors"
    ).stat().st_ino == inode  # adopted, not rebuilt
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["model"]


@pytest.mark.slow
def test_a_kill_while_writing_leaves_no_model_dir_and_the_next_start_builds_it(tmp_path, reference):
    """A real process dies (os._exit, no cleanup) after the weights are written but before the
    tokenizer: RUN_DIR/model does not exist; the next prepare removes the temporary and builds it."""
    run = tmp_path / "run"
    code = textwrap.dedent(
        f"""
        import os
        from transformers import PreTrainedTokenizerFast
        from rlctl.config import RunConfig
        from rlctl.engine.model import prepare_model_dir
        from rlctl.rundir.handle import RunDir
        from rlctl.storage import Storage
        PreTrainedTokenizerFast.save_pretrained = lambda self, out: os._exit(9)
        prepare_model_dir(RunConfig(), RunDir(Storage({str(run)!r})))
        """
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    [tmp] = list(run.iterdir())
    assert tmp.name.startswith(".model.tmp-") and (tmp / "model.safetensors").exists()
    out = prepare_model_dir(RunConfig(), RunDir(Storage(str(run))))
    assert digest(out) == digest(reference) and sorted(p.name for p in run.iterdir()) == ["model"]


def test_object_storage_uses_a_marker_written_last(tmp_path, reference):
    url = f"memory://{tmp_path.name}/run"
    run = Storage(url)
    run.write_bytes("model/config.json", (reference / "config.json").read_bytes())  # half an upload
    out = prepare_model_dir(RunConfig(), RunDir(run))
    assert digest(out) == digest(reference)
    assert run.exists("model", MODEL_COMPLETE) and run.exists("model", "model.safetensors")
    assert any(name.startswith("model.incomplete-") for name in run.listdir())
    again = prepare_model_dir(RunConfig(), RunDir(run))  # complete: fetched as it is
    assert again != out and digest(again) == digest(reference)


def test_a_user_model_dir_that_does_not_load_is_one_sentence(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("garbage")
    with pytest.raises(InputError) as err:
        load_tokenizer(bad)
    assert err.value.message.startswith(f"cannot load a tokenizer from {bad}: ") and "\n" not in err.value.message
    with pytest.raises(InputError) as err:
        load_causal_lm(bad, dtype=torch.float32)
    assert err.value.message.startswith(f"cannot load a causal LM from {bad}: ") and "\n" not in err.value.message


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_the_built_in_model_is_written_as_transformers_own_checkpoint_layout_would_write_it(tmp_path, arch):
    """The built-in model is saved without transformers' step that renames weights back to a checkpoint's
    layout (``save_original_format=False``: it compiles thousands of patterns at every start); for these
    architectures that step renames nothing, so every file is the same bytes either way."""
    from rlctl.engine.model import _save_builtin

    cfg = RunConfig()
    cfg.model.builtin = cfg.model.builtin.model_copy(update={"arch": arch})
    _save_builtin(cfg, tmp_path / "rlctl")
    model = load_causal_lm(tmp_path / "rlctl", torch.float32)
    model.save_pretrained(tmp_path / "transformers")  # save_original_format=True, transformers' default
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "rlctl" / name).read_bytes() == (tmp_path / "transformers" / name).read_bytes(), name
