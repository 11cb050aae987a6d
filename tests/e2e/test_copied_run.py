"""A run directory is self-contained for reading: copied to another machine, where the prompts file, the
reward module and the model directory its config names are absent, it is inspected, checked, listed,
exported, replayed and calibrated (exit 0); resuming it is refused before any work, with the sentence of
a missing file in its config (exit 3)."""

import shutil

import orjson
import pytest
import yaml

from rlctl.config import BuiltinModelConfig
from rlctl.engine.model import build_char_tokenizer, build_tiny_model
from rlctl.errors import ExitCode

from helpers import invoke, run_cli, start_args

# the module-scoped fixtures here: the tests using any of them share one pytest-xdist worker (tests/conftest.py)
SHARED_FIXTURES = ("copied",)

REWARD = "def score(prompts, completions, **columns):\n    return [float(len(c) % 3) for c in completions]\n"


@pytest.fixture(scope="module")
def copied(tmp_path_factory):
    """A 4-step run (snapshots at 2 and 4, the default policy) on a model directory, a prompts file and a
    reward module of the training machine; then the run alone, moved elsewhere, and those three gone."""
    home = tmp_path_factory.mktemp("training_machine")
    tok = build_char_tokenizer()
    build_tiny_model(BuiltinModelConfig(), tok, 0).save_pretrained(home / "model")
    tok.save_pretrained(home / "model")
    prompts = home / "prompts.jsonl"
    prompts.write_bytes(b"".join(orjson.dumps({"prompt": f"{w}="}) + b"\n" for w in ("ab", "cd", "efg", "hi")))
    (home / "copied_reward.py").write_text(REWARD)
    config = {
        "model": {"path": str(home / "model")},
        "data": {"path": str(prompts), "max_prompt_length": 16},
        "reward": {"function": "copied_reward:score"},
        "trainer": {"prompts_per_step": 2},
        "algorithm": {"group_size": 2},
        "rollout": {"max_new_tokens": 4},
        "policies": ["default"],
    }
    run = home / "run"
    r = run_cli(
        "start", *start_args(run, config=config, steps=4, every=2), cwd=home
    )  # the reward module found in the working directory
    assert r.returncode == 0, r.stderr
    copy = tmp_path_factory.mktemp("laptop") / "run"
    shutil.copytree(run, copy)
    shutil.rmtree(home)
    return copy


@pytest.mark.parametrize(
    "command",
    [
        ["inspect"],
        ["inspect", "--check"],
        ["checkpoints"],
        ["checkpoints", "--verify"],
        ["policy", "replay"],
        ["policy", "calibrate"],
    ],
    ids=" ".join,
)
def test_read_only_commands_need_nothing_but_the_run_directory(copied, command):
    r = invoke(*command, str(copied))
    assert r.returncode == 0, r.stderr


def test_a_copied_run_exports(copied, tmp_path):
    r = invoke("export", str(copied), str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()


def test_resuming_a_copied_run_is_refused_before_any_work_naming_the_missing_file(copied):
    """The first of the missing files, in the words and exit code the config's reading gave them before
    reading became independent of the machine."""
    before = sorted(p.relative_to(copied) for p in copied.rglob("*"))
    saved = yaml.safe_load((copied / "config.yaml").read_text())
    r = invoke("resume", str(copied), "--set", "trainer.total_steps=6")
    assert r.returncode == ExitCode.CONFIG == 3
    assert r.stderr.splitlines()[-1] == (
        f"Error: {copied}/config.yaml: invalid config: 'model.path': no such model directory: "
        f"{saved['model']['path']}; 'data.path': no such file: {saved['data']['path']}."
    )
    assert sorted(p.relative_to(copied) for p in copied.rglob("*")) == before  # nothing written, no lease taken
