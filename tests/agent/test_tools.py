"""Tools as the recipe registers them: module:function, a file, a YAML list; their schemas; argument checks."""

from __future__ import annotations

import textwrap

import pytest

from mcore_rl.agent.calculator import calculator
from mcore_rl.agent.tools import ToolError, as_answer, check_arguments, load_tools


def test_a_function_schema_comes_from_its_signature_and_docstring() -> None:
    (spec,) = load_tools(["tests.agent.user_tools:add"])
    assert spec.schema() == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "the first number"},
                    "b": {"type": "integer", "description": "the second number"},
                },
                "required": ["a"],
            },
        },
    }
    assert check_arguments(spec, {"a": 1}) is None
    assert check_arguments(spec, {"a": "1"}) == "wrong arguments for add at a: '1' is not of type 'integer'"
    assert check_arguments(spec, {"b": 1}) == "wrong arguments for add: 'a' is a required property"
    assert check_arguments(spec, [1]) == "arguments of add must be a JSON object, got list"


def test_a_tool_schema_attribute_wins_and_names_the_tool() -> None:
    (spec,) = load_tools(["tests.agent.user_tools:with_schema"])
    assert spec.name == "shout" and spec.function == "tests.agent.user_tools:with_schema"


def test_a_yaml_tool_list_in_verls_spirit(tmp_path) -> None:
    (tmp_path / "mine.py").write_text("def lookup(word):\n    return word[::-1]\n")
    config = tmp_path / "tools.yaml"
    config.write_text(
        textwrap.dedent(
            """
            tools:
              - function: mine.py:lookup
                tool_schema:
                  type: function
                  function:
                    name: reverse
                    description: Reverse a word.
                    parameters: {type: object, properties: {word: {type: string}}, required: [word]}
              - function: mcore_rl.agent.calculator:calculator
            """
        )
    )
    reverse, calc = load_tools([str(config)])
    assert (reverse.name, reverse.function) == ("reverse", str(tmp_path / "mine.py") + ":lookup")
    assert calc.name == "calculator" and calc.parameters["required"] == ["expression"]


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("tests.agent.user_tools:unannotated", "parameter 'x' needs one of the annotations"),
        ("tests.agent.user_tools:nothing", "has no 'nothing'"),
        ("no_such_module_xyz:f", "importing no_such_module_xyz failed"),
        ("calculator", "must be 'module:name'"),
        ("missing.yaml", "missing.yaml does not exist"),
    ],
)
def test_bad_tool_specs_are_named(entry: str, message: str) -> None:
    with pytest.raises(ToolError, match=message):
        load_tools([entry])


def test_bad_yaml_entries_are_named(tmp_path) -> None:
    verl = tmp_path / "verl.yaml"
    verl.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n")
    with pytest.raises(ToolError, match=r"tools\[0\]: needs function: .*class_name tools are classes"):
        load_tools([str(verl)])
    schema = tmp_path / "schema.yaml"
    schema.write_text(
        "tools:\n  - function: mcore_rl.agent.calculator:calculator\n"
        "    tool_schema: {function: {name: c, parameters: {type: object, properties: {x: {type: 7}}}}}\n"
    )
    with pytest.raises(ToolError, match="parameters is not a valid JSON schema"):
        load_tools([str(schema)])
    with pytest.raises(ToolError, match="more than one tool is named add"):
        load_tools(["tests.agent.user_tools:add", "tests.agent.user_tools:add"])


def test_answers_and_the_calculator() -> None:
    assert as_answer("x", "t") == ("x", 0.0)
    assert as_answer(("x", 1), "t") == ("x", 1.0)
    assert as_answer({"text": 5, "reward": 0.5}, "t") == ("5", 0.5)
    with pytest.raises(TypeError, match="expected text"):
        as_answer(None, "t")
    with pytest.raises(TypeError, match="not a number"):
        as_answer(("x", "high"), "t")
    for reward in (float("nan"), float("inf"), -float("inf")):  # a tool error, as a scorer's NaN is refused
        with pytest.raises(TypeError, match="not a finite number"):
            as_answer({"text": "x", "reward": reward}, "t")
    assert calculator("123*45") == "5535" and calculator("(1+2)/4") == "0.75" and calculator("-2**3") == "-8"
    for bad in ("__import__('os')", "2**100000", "1 +", "[1]"):
        with pytest.raises(ValueError):
            calculator(bad)
