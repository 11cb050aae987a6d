"""Tool-call formats (one parsing function each; malformed calls are counted, never raised) and a tool's
JSON schema read from its signature and docstring, with the check of a call's arguments against it."""

import typing

import pytest

from rlctl.config.multi_turn import ToolFormat
from rlctl.tools.formats import FORMATS, ToolCall, parse_hermes, parse_qwen3_coder
from rlctl.tools.schema import check_call, function_schema

import toolbox


def test_the_configs_choices_are_the_registrys():
    assert typing.get_args(ToolFormat) == FORMATS.names == ("hermes", "qwen3_coder")
    assert FORMATS["hermes"].end == "</tool_call>" and FORMATS["hermes"].parse is parse_hermes
    with pytest.raises(KeyError, match="unknown tool-call format 'json'; valid: hermes, qwen3_coder"):
        FORMATS["json"]


def test_hermes_calls_and_malformed_ones():
    text = (
        'I will look. <tool_call>\n{"name": "lookup", "arguments": {"country": "peru"}}\n</tool_call>'
        '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>'  # arguments as a JSON string
        "<tool_call>{name: lookup}</tool_call>"  # not JSON
        '<tool_call>{"arguments": {}}</tool_call>'  # no name
        '<tool_call>{"name": "add", "arguments": [1]}</tool_call>'  # not an object
        '<tool_call>{"name": "lookup"'  # never closed
    )
    turn = parse_hermes(text)
    assert turn.calls == [ToolCall("lookup", {"country": "peru"}), ToolCall("add", {"a": 1})]
    assert turn.invalid == [
        "the tool call is not valid JSON (Expecting property name enclosed in double quotes at character 1)",
        'the tool call has no "name" (expected {"name": ..., "arguments": {...}})',
        'the "arguments" of the call to add are not a JSON object',
        "the last tool call was never closed with </tool_call>",
    ]
    assert turn.attempts == 6
    assert parse_hermes("no call here, 42").attempts == 0


def test_qwen3_coder_calls_and_malformed_ones():
    text = (
        "<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n0.5\n</parameter>\n"
        "</function>\n</tool_call>"
        "<tool_call><function=lookup><parameter=country>new\nzealand</parameter></function></tool_call>"
        "<tool_call>lookup(peru)</tool_call>"
        "<tool_call><function=lookup>peru</function></tool_call>"
    )
    turn = parse_qwen3_coder(text)
    assert turn.calls == [
        ToolCall("add", {"a": "2", "b": "0.5"}, typed=False),
        ToolCall("lookup", {"country": "new\nzealand"}, typed=False),
    ]
    assert turn.invalid == [
        "the tool call is not <function=NAME>...</function>",
        "the call to lookup holds text outside <parameter=NAME>...</parameter>",
    ]


def test_a_schema_is_read_from_the_signature_and_docstring():
    assert function_schema(toolbox.add) == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "number", "description": "The second number, which may be a fraction."},
                    "mode": {
                        "type": "string",
                        "enum": ["plain", "abs"],
                        "description": "plain, or abs for the absolute value.",
                    },
                },
                "required": ["a"],
            },
        },
    }
    assert function_schema(toolbox.pid, name="whoami")["function"]["name"] == "whoami"


def test_calls_are_checked_against_the_schema():
    schemas = {"add": function_schema(toolbox.add), "lookup": function_schema(toolbox.lookup)}
    assert check_call(ToolCall("add", {"a": 1, "b": 2.5}), schemas) == ({"a": 1, "b": 2.5}, None)
    assert check_call(ToolCall("add", {"a": "3", "b": "1"}, typed=False), schemas) == ({"a": 3, "b": 1}, None)
    bad = [
        (ToolCall("mul", {}), "there is no tool named 'mul'; the tools are: add, lookup"),
        (ToolCall("add", {"a": 1, "c": 2}), "add has no argument 'c'; its arguments are: a, b, mode"),
        (ToolCall("add", {"b": 1.0}), "add needs the argument 'a'"),
        (ToolCall("add", {"a": "1"}), "argument 'a' of add: expected integer, got \"1\""),
        (ToolCall("add", {"a": True}), "argument 'a' of add: expected integer, got true"),
        (ToolCall("add", {"a": "x"}, typed=False), "argument 'a' of add: expected integer, got 'x'"),
        (
            ToolCall("add", {"a": 1, "mode": "neg"}),
            'argument \'mode\' of add: expected one of ["plain", "abs"], got "neg"',
        ),
    ]
    for call, sentence in bad:
        assert check_call(call, schemas) == (None, sentence)
