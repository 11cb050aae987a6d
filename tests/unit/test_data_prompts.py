"""data.system_prompt (through the chat template) and data.filter_overlong_prompts, on real tokenizers
(the built-in char tokenizer, and the same with a Jinja chat template, saved and loaded as a model
directory's tokenizer is) and real JSONL and parquet files."""

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic
import pytest
import yaml

from rlctl.config import DataConfig, RunConfig
from rlctl.config.load import load_config
from rlctl.engine.data import (
    PromptCursor,
    check_prompt_template,
    load_prompts,
    prompt_lengths,
    prompt_texts,
    read_prompt_file,
)
from rlctl.engine.model import build_char_tokenizer, load_tokenizer
from rlctl.errors import ConfigError, ExitCode, InputError
from rlctl.rundir.handle import RunDir

# Roles by their first letter, each message ended by '.', and the assistant's turn opened by 'a:'.
TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}.{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
NO_SYSTEM = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('system role not supported') }}{% endif %}"


@pytest.fixture
def chat_tokenizer(tmp_path):
    """The built-in char tokenizer with TEMPLATE, through save_pretrained and rlctl's own loader."""
    tok = build_char_tokenizer()
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp_path / "tok")
    return load_tokenizer(tmp_path / "tok")


def write_jsonl(path, prompts):
    path.write_bytes(b"".join(orjson.dumps({"prompt": p, "target": str(i)}) + b"\n" for i, p in enumerate(prompts)))
    return path


def run_config(**data) -> RunConfig:
    """A run that validates when it has held-out prompts (data.val_path, or the built-in task's)."""
    validates = "val_path" in data or "path" not in data
    return RunConfig(data=DataConfig(**data), trainer={"prompts_per_step": 2, "val_every": int(validates)})


def test_system_prompt_turns_the_template_on_and_refuses_it_off(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"data": {"system_prompt": "be brief"}}))
    loaded = load_config(cfg)
    assert loaded.data.apply_chat_template is True
    assert yaml.safe_load(loaded.to_yaml())["data"]["apply_chat_template"] is True  # the saved config says so
    assert load_config(cfg, ["data.apply_chat_template=true"]).data.system_prompt == "be brief"
    with pytest.raises(ConfigError) as err:
        load_config(cfg, ["data.apply_chat_template=false"])
    assert err.value.exit_code == ExitCode.CONFIG
    assert "'data' (c.yaml line 1): system_prompt is set but apply_chat_template is false" in err.value.message
    for falsy in ("off", "no", "False", 0):  # whatever pydantic reads as false is refused alike
        with pytest.raises(pydantic.ValidationError, match="system_prompt is set but apply_chat_template is false"):
            DataConfig.model_validate({"system_prompt": "s", "apply_chat_template": falsy})
    with pytest.raises(ConfigError, match="apply_chat_template"):  # not a bool: the field's own error
        load_config(cfg, ["data.apply_chat_template=maybe"])
    assert DataConfig().apply_chat_template is False and DataConfig().filter_overlong_prompts is False


def test_prompt_texts_put_the_system_message_first(chat_tokenizer):
    with_system = DataConfig(system_prompt="be brief")
    assert prompt_texts(chat_tokenizer, with_system, ["hi", "2+2?"]) == ["s:be brief.u:hi.a:", "s:be brief.u:2+2?.a:"]
    assert prompt_texts(chat_tokenizer, DataConfig(apply_chat_template=True), ["hi"]) == ["u:hi.a:"]
    assert prompt_texts(chat_tokenizer, DataConfig(), ["hi"]) == ["hi"]
    # lengths as the rollout encodes: the template's text without <bos>; a raw prompt with it
    assert prompt_lengths(chat_tokenizer, with_system, ["hi"]) == [len("s:be brief.u:hi.a:")]
    assert prompt_lengths(chat_tokenizer, DataConfig(), ["hi"]) == [3]


def test_a_tokenizer_without_a_chat_template_is_a_config_error(tmp_path):
    cfg = run_config(path=str(write_jsonl(tmp_path / "p.jsonl", ["ab"])), system_prompt="be brief")
    with pytest.raises(ConfigError) as err:
        load_prompts(cfg, build_char_tokenizer())
    assert err.value.message == (
        "'data.system_prompt' needs a chat template, but the tokenizer of the built-in model has none (no "
        "chat_template in its tokenizer files); use a model with one, or leave 'data.system_prompt' unset"
    )
    tok = build_char_tokenizer()
    tok.chat_template = NO_SYSTEM
    with pytest.raises(ConfigError, match="fails on a system\\+user conversation: system role not supported"):
        load_prompts(cfg, tok)
    cfg.data.system_prompt = None  # the template alone renders
    assert load_prompts(cfg, tok).train[0]["prompt"] == "ab"


def test_the_preflight_checks_the_template_before_any_work(tmp_path, chat_tokenizer):
    check_prompt_template(RunConfig())  # no template asked for: nothing is loaded
    with pytest.raises(
        ConfigError, match="^'data.apply_chat_template' needs a chat template, but the tokenizer of the built-in"
    ):
        check_prompt_template(RunConfig(data={"apply_chat_template": True}))
    bare = tmp_path / "bare"
    build_char_tokenizer().save_pretrained(bare)
    with pytest.raises(ConfigError, match=f"the tokenizer of {bare} has none"):
        check_prompt_template(RunConfig(model={"path": str(bare)}, data={"system_prompt": "be brief"}))
    check_prompt_template(RunConfig(model={"path": str(tmp_path / "tok")}, data={"system_prompt": "be brief"}))


def test_overlong_prompts_are_dropped_after_the_template_and_counted(tmp_path, chat_tokenizer, capsys):
    # with the system prompt "sys" a prompt p becomes "s:sys.u:" + p + ".a:": 11 tokens more than p
    prompts = ["a" * 9, "b" * 10, "c", "d" * 8, "e" * 30]
    train = write_jsonl(tmp_path / "train.jsonl", prompts)
    val = tmp_path / "val.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "x" * n} for n in (1, 12, 9)]), val)
    cfg = run_config(
        path=str(train), val_path=str(val), system_prompt="sys", max_prompt_length=20, filter_overlong_prompts=True
    )
    loaded = load_prompts(cfg, chat_tokenizer)
    assert [r["prompt"] for r in loaded.train] == ["a" * 9, "c", "d" * 8]  # 20, 12, 19 tokens; 21 and 41 dropped
    assert [r["target"] for r in loaded.train] == ["0", "2", "3"]  # the other columns stay with their prompt
    assert [r["prompt"] for r in loaded.val] == ["x", "x" * 9]
    events = []
    loaded.announce(events.append, main=True)
    assert events == [
        {
            "event": "prompts_filtered",
            "data": "data.path",
            "file": str(train),
            "prompts": 5,
            "dropped": 2,
            "kept": 3,
            "max_prompt_length": 20,
            "longest": 41,
        },
        {
            "event": "prompts_filtered",
            "data": "data.val_path",
            "file": str(val),
            "prompts": 3,
            "dropped": 1,
            "kept": 2,
            "max_prompt_length": 20,
            "longest": 23,
        },
    ]
    err = capsys.readouterr().err
    assert f"'data.path' {train}: dropped 2 of 5 prompts longer than 20 tokens" in err
    loaded.announce(events.append, main=False)  # other ranks record, and say nothing
    assert capsys.readouterr().err == "" and len(events) == 4


def test_filtering_is_deterministic_and_the_cursor_resumes_on_it(tmp_path, chat_tokenizer):
    prompts = [("q" * (i % 13)) + str(i) for i in range(60)]
    cfg = run_config(path=str(write_jsonl(tmp_path / "p.jsonl", prompts)), max_prompt_length=12)
    cfg.data.filter_overlong_prompts = True
    first = load_prompts(cfg, chat_tokenizer).train
    assert first == load_prompts(cfg, chat_tokenizer).train
    assert 0 < len(first) < len(prompts)  # raw prompts: <bos> + text, so texts of 11 characters at most stay
    assert all(len(r["prompt"]) <= 11 for r in first)
    a = PromptCursor(first, seed=5)
    a.next_batch(7)
    state = a.state_dict()
    expected = a.next_batch(9)
    b = PromptCursor(load_prompts(cfg, chat_tokenizer).train, seed=5)
    b.load_state_dict(state)
    assert b.next_batch(9) == expected
    cfg.data.filter_overlong_prompts = False  # off: every prompt stays (the rollout truncates from the left)
    unfiltered = load_prompts(cfg, chat_tokenizer)
    assert len(unfiltered.train) == len(prompts) and unfiltered.filtered == []
    with pytest.raises(InputError, match="now has 60 rows but the snapshot was taken with"):
        PromptCursor(unfiltered.train, seed=5).load_state_dict(state)
    other = [*first[:-1], {"prompt": "z"}]  # as many rows, one other (another tokenizer kept another prompt)
    with pytest.raises(InputError, match=f"the dataset's {len(first)} prompts are not the ones the snapshot"):
        PromptCursor(other, seed=5).load_state_dict(state)
    older = {k: v for k, v in state.items() if k != "rows_digest"}  # a snapshot from before the digest
    PromptCursor(other, seed=5).load_state_dict(older)


def test_every_prompt_dropped_names_the_file_and_the_limit(tmp_path, chat_tokenizer):
    path = write_jsonl(tmp_path / "long.jsonl", ["abcdef", "abcdefgh"])
    cfg = run_config(path=str(path), max_prompt_length=4, filter_overlong_prompts=True)
    with pytest.raises(InputError) as err:
        load_prompts(cfg, chat_tokenizer)
    assert err.value.exit_code == ExitCode.INPUT
    assert err.value.message == (
        f"every prompt of 'data.path' {path} is longer than 'data.max_prompt_length' (4 tokens; the shortest "
        "has 7), so 'data.filter_overlong_prompts' leaves none: raise the limit"
    )


def test_the_built_in_task_is_filtered_too(chat_tokenizer):
    cfg = run_config(builtin_size=200, builtin_val_size=20, max_prompt_length=4, filter_overlong_prompts=True)
    cfg.trainer.val_every = 0
    loaded = load_prompts(cfg, chat_tokenizer)  # "word=" with <bos>: words of 2 letters fit in 4 tokens
    assert loaded.train and all(len(r["prompt"]) == 3 for r in loaded.train) and loaded.val is None
    assert loaded.filtered[0].source == "the built-in task" and loaded.filtered[0].total == 200
    cfg.trainer.val_every = 1  # the held-out split has words of 3 and 4 letters: none fits
    with pytest.raises(InputError, match="of 'data.val_path' the built-in task's held-out split is longer"):
        load_prompts(cfg, chat_tokenizer)


def test_a_list_of_messages_is_refused_in_one_sentence(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_bytes(orjson.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + b"\n")
    with pytest.raises(InputError) as err:
        read_prompt_file(path, "prompt", "data.path")
    assert err.value.message == (
        f"'data.path' {path}: row 1's 'prompt' is a list of messages, which rlctl does not read; give the "
        "user's text as a string (with 'data.apply_chat_template') and a system message as 'data.system_prompt'"
    )


def test_the_rollout_gives_the_model_the_system_prompt_as_load_prompts_measures_it(runtime, tmp_path):
    """HFRollout.encode (vLLM's too) renders prompts with prompt_texts: what the filter measured is what
    the model sees, and a prompt of exactly data.max_prompt_length tokens is not cut."""
    from rlctl.engine.actor import Actor
    from rlctl.engine.model import prepare_model_dir
    from rlctl.engine.rollout.hf import HFRollout
    from rlctl.storage import Storage

    cfg = RunConfig.model_validate({"data": {"system_prompt": "sys", "max_prompt_length": 14}})
    model_dir = prepare_model_dir(cfg, RunDir(Storage(str(tmp_path / "run"))))
    tok = load_tokenizer(model_dir)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(model_dir)
    tok = load_tokenizer(model_dir)
    rollout = HFRollout(cfg, Actor(cfg, model_dir, runtime), tok)
    enc = rollout.encode(["ab=", "c"])
    assert tok.decode(enc["input_ids"][0][enc["attention_mask"][0].bool()]) == "s:sys.u:ab=.a:"
    assert enc["attention_mask"].sum(-1).tolist() == prompt_lengths(tok, cfg.data, ["ab=", "c"]) == [14, 12]


def test_multi_turn_prompts_are_measured_with_the_tools_schemas(tmp_path):
    """The template renders the tools' schemas into every prompt, so the filter counts them: a prompt that
    fits alone but not with the schemas is dropped (else the rollout's left truncation would cut them)."""
    from rlctl.tools.schema import function_schema

    from chat_tokenizer import build_chat_tokenizer
    from toolbox import lookup

    tok = build_chat_tokenizer()
    tools = [function_schema(lookup, "lookup")]
    path = str(write_jsonl(tmp_path / "t.jsonl", ["capital of peru?"]))

    def cfg(limit: int) -> RunConfig:
        return run_config(path=path, apply_chat_template=True, filter_overlong_prompts=True, max_prompt_length=limit)

    [bare] = prompt_lengths(tok, cfg(1000).data, ["capital of peru?"])
    [with_tools] = prompt_lengths(tok, cfg(1000).data, ["capital of peru?"], tools=tools)
    assert with_tools > bare + 20
    assert len(load_prompts(cfg(with_tools), tok, tools).train) == 1
    assert len(load_prompts(cfg(with_tools - 1), tok).train) == 1  # without the schemas it would fit
    with pytest.raises(InputError, match="every prompt of 'data.path'"):
        load_prompts(cfg(with_tools - 1), tok, tools)
