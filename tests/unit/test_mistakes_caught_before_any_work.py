"""``check_before_start``: what can be checked before any work, in seconds, with real modules, model
directories and this machine's devices."""

import json

import pytest
import torch

from rlctl.config import load_config, validate_config
from rlctl.errors import ConfigError, ExitCode, InputError
from rlctl.preflight import check_before_start


def config(**sections):
    return validate_config(sections)


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


@pytest.fixture
def tiny_model_dir(tmp_path):
    """A real Hugging Face causal-LM directory whose context is 64 positions."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path / "tiny"
    cfg = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
        max_position_embeddings=64,
    )  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


def test_the_demo_config_passes():
    check_before_start(config())


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_cuda_without_a_gpu_is_named_before_any_work():
    with pytest.raises(ConfigError, match="'device' is cuda but torch sees no CUDA device"):
        check_before_start(config(device="cuda"))


def test_ray_ranks_check_their_own_devices():
    """The driver of a Ray run may have no GPU while its workers do: not checked here."""
    check_before_start(config(device="cuda", cluster={"backend": "ray"}))


def test_prompt_plus_completion_beyond_the_builtin_context():
    cfg = config(data={"max_prompt_length": 1000}, rollout={"max_new_tokens": 100})
    with pytest.raises(ConfigError) as err:
        check_before_start(cfg)
    assert err.value.message == (
        "'data.max_prompt_length' (1000) + 'rollout.max_new_tokens' (100) = 1100 tokens exceed the 1024 "
        "positions of the built-in model (max_position_embeddings); lower them to fit"
    )
    check_before_start(config(data={"max_prompt_length": 1000}, rollout={"max_new_tokens": 24}))


def test_prompt_plus_completion_beyond_a_models_context(tiny_model_dir):
    cfg = config(model={"path": str(tiny_model_dir)}, data={"max_prompt_length": 60}, rollout={"max_new_tokens": 8})
    with pytest.raises(ConfigError, match=f"exceed the 64 positions of the model in {tiny_model_dir} "):
        check_before_start(cfg)
    check_before_start(
        config(model={"path": str(tiny_model_dir)}, data={"max_prompt_length": 56}, rollout={"max_new_tokens": 8})
    )


def test_a_model_dir_that_cannot_load_is_named(tiny_model_dir):
    small = {"data": {"max_prompt_length": 8}, "rollout": {"max_new_tokens": 8}}
    (tiny_model_dir / "model.safetensors").unlink()
    with pytest.raises(InputError, match=f"the model directory {tiny_model_dir} holds no weights"):
        check_before_start(config(model={"path": str(tiny_model_dir)}, **small))
    (tiny_model_dir / "config.json").write_text("{not json")
    with pytest.raises(InputError) as err:
        check_before_start(config(model={"path": str(tiny_model_dir)}, **small))
    assert err.value.message.startswith(f"cannot read the model config in {tiny_model_dir}: ")
    assert "\n" not in err.value.message and err.value.exit_code == ExitCode.INPUT
    (tiny_model_dir / "config.json").unlink()
    with pytest.raises(InputError, match=f"cannot read the model config in {tiny_model_dir}"):
        check_before_start(config(model={"path": str(tiny_model_dir)}, **small))


def test_the_reward_function_is_imported_and_checked(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="'reward.function': cannot import module 'no_reward_mod_here'"):
        check_before_start(config(reward={"function": "no_reward_mod_here:f"}))
    (tmp_path / "broken_at_import.py").write_text("raise RuntimeError('API key missing')\n")
    with pytest.raises(InputError, match="importing module 'broken_at_import' raised RuntimeError: API key missing"):
        check_before_start(config(reward={"function": "broken_at_import:f"}))
    (tmp_path / "fine_reward.py").write_text(
        "def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    with pytest.raises(ConfigError, match="module 'fine_reward' has no function 'g'"):
        check_before_start(config(reward={"function": "fine_reward:g"}))
    check_before_start(config(reward={"function": "fine_reward:f"}))


def test_a_dataset_that_went_away_since_the_config_was_written(tmp_path):
    """Reading a config never looks for its files (a run's saved config reads anywhere): the preflight
    does, in the sentence of a mistake in the config."""
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"prompt": "a"}) + "\n")
    cfg = config(data={"path": str(data)})
    check_before_start(cfg)
    data.unlink()
    assert config(data={"path": str(data)}) == cfg
    with pytest.raises(ConfigError) as err:
        check_before_start(cfg)
    assert (err.value.message, err.value.exit_code) == (f"invalid config: 'data.path': no such file: {data}.", 3)


def test_a_dataset_that_cannot_be_read(tmp_path):
    unreadable = tmp_path / "d.jsonl"
    unreadable.symlink_to("/proc/self/mem")  # a file whose first byte cannot be read, even by root
    with pytest.raises(InputError, match=f"cannot read 'data.path' {unreadable}: Input/output error"):
        check_before_start(config(data={"path": str(unreadable)}))


def test_every_directory_file_and_protocol_a_config_names_is_checked_in_one_located_sentence(tmp_path):
    """What the config's validation said of them before it checked shape and values only."""
    (tmp_path / "plain").mkdir()
    (tmp_path / "d.csv").write_text("prompt\n")
    cfg = load_config(
        write(tmp_path, f"model:\n  path: /no/m\ndata:\n  path: /no/d.jsonl\n  val_path: {tmp_path / 'plain'}\n"),
        [
            "reward.sources=[{function: 'a:b'}, {model: {path: /no/rm}}]",
            "checkpoint.dir=s4://b",
            "critic.path=/no/c",
        ],
    )
    with pytest.raises(ConfigError) as err:
        check_before_start(cfg)
    assert err.value.message == (
        "invalid config: 'model.path' (run.yaml line 2): no such model directory: /no/m; "
        "'data.path' (run.yaml line 4): no such file: /no/d.jsonl; "
        f"'data.val_path' (run.yaml line 5): {tmp_path}/plain is a directory but not a `datasets` directory "
        "(save_to_disk); "
        "'reward.sources.1.model.path' (--set reward.sources=[{function: 'a:b'}, {model: {path: /no/rm}}]): "
        "no such model directory: /no/rm; "
        "'checkpoint.dir' (--set checkpoint.dir=s4://b): unknown storage protocol 's4://' in 's4://b'; "
        "did you mean s3:// or gs://?; "
        "'(top level)': critic.path: no such model directory: /no/c."
    )
    with pytest.raises(ConfigError, match=r"'data.path': expected a .jsonl or .parquet file, got d.csv.$"):
        check_before_start(config(data={"path": str(tmp_path / "d.csv")}))
    with pytest.raises(ConfigError, match=r"^invalid config: 'reward.model.path': no such model directory: /no/rm.$"):
        check_before_start(config(reward={"model": {"path": "/no/rm"}}))


def test_a_saved_config_is_named_by_its_file(tmp_path):
    """A run's config.yaml reads without its data; a resume's preflight names the file, as its reading did."""
    from rlctl.rundir.directory import load_run_config
    from rlctl.rundir.overrides import apply_resume_overrides
    from rlctl.storage import Storage

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("data:\n  path: /no/d.jsonl\n")
    cfg, _ = apply_resume_overrides(load_run_config(Storage(str(run))), ["trainer.total_steps=5"])
    assert cfg.data.path == "/no/d.jsonl" and cfg.trainer.total_steps == 5
    with pytest.raises(ConfigError) as err:
        check_before_start(cfg)
    assert err.value.message == f"{run}/config.yaml: invalid config: 'data.path': no such file: /no/d.jsonl."


def test_a_checkpoint_filesystem_that_is_not_installed(monkeypatch):
    from fsspec.registry import known_implementations

    monkeypatch.setitem(
        known_implementations,
        "zzfs",
        {"class": "zzfs_not_installed.ZZFileSystem", "err": "Install zzfs_not_installed to use zzfs://"},
    )
    cfg = config(checkpoint={"dir": "zzfs://bucket/ckpt"})
    with pytest.raises(ConfigError) as err:
        check_before_start(cfg)
    assert err.value.message == (
        "'checkpoint.dir' is zzfs://bucket/ckpt, but the zzfs:// filesystem is not available: "
        "Install zzfs_not_installed to use zzfs://"
    )
    check_before_start(config(checkpoint={"dir": "memory://ckpt"}))


def test_it_loads_no_weights(monkeypatch, tiny_model_dir):
    """Fast: configs only, never a model's weights."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("preflight loaded weights")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", refuse)
    check_before_start(
        config(model={"path": str(tiny_model_dir)}, data={"max_prompt_length": 8}, rollout={"max_new_tokens": 8})
    )


@pytest.fixture
def tool_model(tmp_path):
    """A model directory with a real BPE tokenizer whose chat template renders tools (ChatML, Hermes)."""
    from chat_tokenizer import tool_model_dir

    return tool_model_dir(tmp_path / "tool-model")


def multi_turn(model_dir, tools=({"function": "toolbox:lookup"},), **mt):
    return config(
        model={"path": str(model_dir)},
        data={"apply_chat_template": True, "max_prompt_length": 400},
        rollout={"max_new_tokens": 32, "multi_turn": {"tools": list(tools), "max_total_tokens": 200, **mt}},
    )


def test_multi_turn_tools_and_template_are_checked_before_any_work(tool_model):
    check_before_start(multi_turn(tool_model))
    with pytest.raises(ConfigError) as err:
        check_before_start(multi_turn(tool_model, [{"function": "toolbox:lookup"}, {"function": "toolbox:nope"}]))
    assert err.value.message == "'rollout.multi_turn.tools[1].function': module 'toolbox' has no function 'nope'"
    assert err.value.exit_code == ExitCode.CONFIG == 3
    with pytest.raises(ConfigError, match=r"tools\[0\].function': cannot import module 'no_such_tools'"):
        check_before_start(multi_turn(tool_model, [{"function": "no_such_tools:f"}]))


def test_a_chat_template_that_cannot_render_increments_is_exit_3_before_any_work(tool_model):
    from chat_tokenizer import NOT_INCREMENTAL

    tok = json.loads((tool_model / "tokenizer_config.json").read_text())
    tok["chat_template"] = NOT_INCREMENTAL
    (tool_model / "tokenizer_config.json").write_text(json.dumps(tok))
    for extra in ("chat_template.jinja",):  # a template file, where transformers saved one, wins over the json
        (tool_model / extra).unlink(missing_ok=True)
    with pytest.raises(ConfigError) as err:
        check_before_start(multi_turn(tool_model))
    assert err.value.exit_code == ExitCode.CONFIG == 3
    assert err.value.message.startswith("'rollout.multi_turn': the chat template of ") and "incrementally" in (
        err.value.message
    )


def test_a_conversation_must_fit_the_models_context(tool_model):
    with pytest.raises(ConfigError) as err:
        check_before_start(multi_turn(tool_model, max_total_tokens=700))
    assert err.value.message == (
        "'data.max_prompt_length' (400) + 'rollout.multi_turn.max_total_tokens' (700) = 1100 tokens exceed the "
        "1024 positions of the model in " + str(tool_model) + " (max_position_embeddings); lower them to fit"
    )
