"""rollout.multi_turn's config: strict, its sentences located; a tool file inlined where the config is
loaded (its keys located in it)."""

import pytest

from rlctl.config import load_config
from rlctl.config.multi_turn import MultiTurnConfig, ToolConfig
from rlctl.errors import ConfigError


def write(path, text):
    path.write_text(text)
    return path


def test_values_and_shapes_are_checked():
    assert MultiTurnConfig(tools=[{"function": "toolbox:lookup"}]).tools[0].label == "lookup"
    bad = [
        ({"tools": []}, "declare at least one tool ('tools' or 'tools_file') or an 'environment'"),
        ({"tools": [{"function": "toolbox"}]}, "expected 'module:function', got 'toolbox'"),
        ({"tools": [{"function": "a:f"}, {"function": "b:f"}]}, "tool names must be unique (repeated: f)"),
        ({"tools": [{"function": "a:f", "name": "f/x"}]}, "it becomes a metric name"),
        ({"tools": [{"stateful": "a"}]}, "expected 'module:Class', got 'a'"),
        ({"tools": [{"stateful": "a:Box", "function": "a:f"}]}, "one of them (both given)"),
        ({"tools": [{"name": "x"}]}, "one of them (neither given)"),
        ({"tools": [{"function": "a:f"}], "environment": "a:Env"}, "declare it or tools, not both"),
        ({"environment": "Env"}, "expected 'module:Class', got 'Env'"),
        ({"tools": [{"function": "a:f"}], "format": "json"}, "hermes"),
        ({"tools": [{"function": "a:f"}], "tool_timeout_s": 0}, "greater than 0"),
    ]
    for data, sentence in bad:
        with pytest.raises(ValueError, match=sentence.replace("(", r"\(").replace(")", r"\)")):
            MultiTurnConfig.model_validate(data)
    assert ToolConfig(function="a:f", name="g").label == "g"
    assert ToolConfig(stateful="a:Box").label == "Box" and ToolConfig(stateful="a:Box").spec == "a:Box"
    assert MultiTurnConfig(environment="games:Guess").tools == []
    # the sandbox's wall time is checked against the tool timeout only where the built-in python tool runs
    assert MultiTurnConfig(tools=[{"function": "a:f"}], tool_timeout_s=5).sandbox.wall_time_s == 5
    with pytest.raises(ValueError, match=r"sandbox.wall_time_s \(5\) must be under tool_timeout_s \(5\)"):
        MultiTurnConfig(tools=[{"stateful": "rlctl.tools.python:Python"}], tool_timeout_s=5)


def test_a_tool_file_is_inlined_and_its_mistakes_located(tmp_path):
    write(tmp_path / "tools.yaml", "tools:\n  - function: toolbox:lookup\n  - function: toolbox\n")
    cfg = write(
        tmp_path / "run.yaml",
        "data: {apply_chat_template: true}\nrollout:\n  multi_turn:\n    tools_file: tools.yaml\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(cfg)
    assert err.value.message == (
        "invalid config: 'rollout.multi_turn.tools.1.function' (tools.yaml line 3): expected 'module:function', "
        "got 'toolbox'."
    )
    write(tmp_path / "tools.yaml", "tools:\n  - function: toolbox:lookup\n  - {function: toolbox:add, name: plus}\n")
    tools = load_config(cfg).rollout.multi_turn.tools  # well formed: inlined, in order
    assert [(t.function, t.label) for t in tools] == [("toolbox:lookup", "lookup"), ("toolbox:add", "plus")]
    write(tmp_path / "tools.yaml", "tools:\n  - function: toolbox:lookup\n    name: find\n    name: look\n")
    with pytest.raises(ConfigError) as err:  # a key given twice: never the last word
        load_config(cfg)
    assert err.value.message == (
        "'rollout.multi_turn.tools_file' (run.yaml line 4): tools.yaml: 'tools.0.name' is given twice: line 3 "
        "and line 4; a key is written once in a mapping: keep one"
    )
    write(tmp_path / "tools.yaml", "- function: toolbox:lookup\n")
    with pytest.raises(ConfigError, match="tools_file' \\(run.yaml line 4\\): tools.yaml must be a mapping"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="tools_file' \\(run.yaml line 4\\): tool file not found"):
        load_config(write(cfg, cfg.read_text().replace("tools.yaml", "nope.yaml")))


def test_multi_turn_needs_the_chat_template_on_either_backend(tmp_path):
    tools = "rollout: {multi_turn: {tools: [{function: 'toolbox:lookup'}]}"
    with pytest.raises(ConfigError, match="set data.apply_chat_template to true"):
        load_config(write(tmp_path / "a.yaml", tools + "}\n"))
    on_vllm = load_config(write(tmp_path / "b.yaml", tools + ", backend: vllm}\ndata: {apply_chat_template: true}\n"))
    assert on_vllm.rollout.backend == "vllm" and on_vllm.rollout.multi_turn is not None  # both backends
    with pytest.raises(ConfigError, match=r"max_total_tokens \(16\) must be at least max_new_tokens \(256\)"):
        load_config(
            write(
                tmp_path / "c.yaml",
                tools.replace("multi_turn: {", "multi_turn: {max_total_tokens: 16, ")
                + "}\ndata: {apply_chat_template: true}\n",
            )
        )


def test_the_tool_retry_budget_is_a_count_of_steps_from_zero(tmp_path):
    """3 by default; 0 ends at the first step with its tools down; a negative count or a word is refused,
    located; and the key documents itself (the config reference is generated from it)."""
    tools = [{"function": "toolbox:lookup"}]
    assert MultiTurnConfig(tools=tools).tool_retry_budget == 3
    assert MultiTurnConfig(tools=tools, tool_retry_budget=0).tool_retry_budget == 0
    for bad, sentence in ((-1, "greater than or equal to 0"), ("three", "valid integer"), (1.5, "valid integer")):
        with pytest.raises(ValueError, match=sentence):
            MultiTurnConfig(tools=tools, tool_retry_budget=bad)
    cfg = write(
        tmp_path / "run.yaml",
        "data: {apply_chat_template: true}\nrollout:\n  multi_turn:\n    tools: [{function: 'toolbox:lookup'}]\n"
        "    tool_retry_budget: -2\n",
    )
    with pytest.raises(ConfigError, match=r"'rollout.multi_turn.tool_retry_budget' \(run.yaml line 5\)"):
        load_config(cfg)
    assert "exit 75" in MultiTurnConfig.model_fields["tool_retry_budget"].description
