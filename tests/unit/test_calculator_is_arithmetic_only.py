"""The ready-made calculator tool: arithmetic only, parsed with ast (never eval), bounded powers, every
mistake a ValueError the model reads back; and the GPU example configs that use it load as they are."""

from pathlib import Path

import pytest

from rlctl.config.load import load_config
from rlctl.tools.calculator import calculate
from rlctl.tools.schema import function_schema

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("2 + 3 * 4", "14"),
        ("(48 / 2) * 3 + 1.5", "73.5"),
        ("-7 // 2", "-4"),
        ("2 ** 10 % 1000", "24"),
        ("6 / 4", "1.5"),
        ("8 / 4", "2"),
    ],
)
def test_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize(
    ("expression", "says"),
    [
        ("__import__('os').system('true')", "only numbers"),
        ("x + 1", "only numbers"),
        ("'a' * 3", "only numbers"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 99 * 10 ** 99", "over 10**100"),
        ("1 / 0", "division by zero"),
        ("2 +", "not an arithmetic expression"),
    ],
)
def test_anything_else_is_a_value_error_for_the_model(expression, says):
    with pytest.raises(ValueError, match=says.replace("*", r"\*")):
        calculate(expression)


def test_its_schema_tells_the_model_what_to_write():
    schema = function_schema(calculate, "calculate")["function"]
    assert schema["parameters"]["required"] == ["expression"]
    assert "parentheses" in schema["parameters"]["properties"]["expression"]["description"]


@pytest.mark.parametrize("name", ["gsm8k-gpu.yaml", "gsm8k-tools-gpu.yaml"])
def test_the_gpu_examples_load(name):
    cfg = load_config(EXAMPLES / name)
    assert cfg.device == "cuda" and cfg.reward.function == "rlctl.engine.reward.gsm8k:exact_match"
