"""A tool the model may call: a name, the JSON schema of its arguments, and a function returning text (and
optionally a reward), as the OpenAI / Hermes function-calling convention describes it.

Registered from the recipe (``rollout.multi_turn.tools``), each entry one of:

* ``module:function`` or ``path/to/file.py:function``: the function's schema is its ``tool_schema``
  attribute (an OpenAI ``{"type": "function", "function": {...}}`` object or its inner ``function`` part),
  else read from its signature (annotations ``str``, ``int``, ``float``, ``bool``, ``list``, ``dict``; a
  parameter without a default is required) and docstring (the first paragraph describes the tool; an
  ``Args:`` section describes the parameters);
* a YAML file in the spirit of verl's tool config::

      tools:
        - function: my_pkg.tools:search          # what runs (ours: a function, not verl's class)
          tool_schema:                           # verl's / OpenAI's schema, as the model sees it
            type: function
            function: {name: search, description: ..., parameters: {type: object, properties: ..., required: [...]}}

The function runs in a tool worker process (``executor.py``), called with the model's arguments as keywords;
it returns text, ``(text, reward)`` or ``{"text": ..., "reward": ...}`` (numbers become text; a reward that is
not a finite number makes the call a tool error). Arguments are checked against the schema (``jsonschema``)
before the call; a call that breaks it is answered with the validation error and never runs.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mcore_rl.io.errors import InputError


class ToolError(InputError):
    """A tool spec we cannot use (unloadable, no schema, a bad YAML entry); the message names it."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool, as the model sees it and as a worker runs it."""

    name: str
    description: str
    parameters: dict[str, Any]
    """JSON schema of the arguments (an ``object`` schema)."""
    function: str
    """``module:function`` or ``path/to/file.py:function``: what a tool worker loads and calls."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI function schema (what a chat template's ``tools=`` renders into the prompt)."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    """A call the model wrote: the tool's name and its arguments as parsed from the JSON it wrote."""

    name: str
    arguments: Any


@dataclass(frozen=True)
class ToolAnswer:
    """What a tool call (or an environment step) gave back."""

    text: str
    """What the model reads next (an error message when the call failed)."""
    reward: float = 0.0
    status: str = "ok"
    """ok, error (the function raised or returned a non-answer), timeout, bad_call (unknown tool, wrong
    arguments, malformed call: never ran)."""


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def load_function(spec: str, what: str = "tool") -> Callable[..., Any]:
    """The callable named ``module:name`` or ``path/to/file.py:name`` (a function or a class); ``what`` names
    it in errors (tool, environment, tool parser)."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ToolError(f"{what} {spec!r} must be 'module:name' or 'path/to/file.py:name'")
    try:
        if target.endswith(".py"):
            if not os.path.isfile(target):
                raise ToolError(f"{what} {spec!r}: file {target} does not exist")
            module_name = f"_mcore_rl_user_{what.replace(' ', '_')}_{abs(hash(os.path.abspath(target)))}"
            loader_spec = importlib.util.spec_from_file_location(module_name, target)
            assert loader_spec is not None and loader_spec.loader is not None
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[module_name] = module
            loader_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(target)
    except ToolError:
        raise
    except Exception as err:  # the user's module fails on import (missing, a syntax error, a raise)
        raise ToolError(f"{what} {spec!r}: importing {target} failed ({type(err).__name__}: {err})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ToolError(f"{what} {spec!r}: {target} has no {name!r}")
    return fn


def signature_schema(fn: Callable[..., Any], spec: str) -> dict[str, Any]:
    """The OpenAI function schema of ``fn`` from its signature and docstring (module docstring)."""
    import typing

    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: treated as missing
        hints = {}
    doc = inspect.getdoc(fn) or ""
    described = _arg_descriptions(doc)
    properties: dict[str, Any] = {}
    required = []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _JSON_TYPES.get(typing.get_origin(hints.get(name)) or hints.get(name))  # type: ignore[arg-type]
        if kind is None:
            raise ToolError(
                f"tool {spec!r}: parameter {name!r} needs one of the annotations str, int, float, bool, list, "
                "dict (or give the function a tool_schema attribute)"
            )
        properties[name] = {"type": kind, **({"description": described[name]} if name in described else {})}
        if param.default is param.empty:
            required.append(name)
    description = doc.split("\n\n")[0].replace("\n", " ").strip()
    parameters = {"type": "object", "properties": properties, "required": required}
    return {
        "type": "function",
        "function": {"name": fn.__name__, "description": description, "parameters": parameters},
    }


def _arg_descriptions(doc: str) -> dict[str, str]:
    """``name: text`` lines of a Google-style ``Args:`` section."""
    match = re.search(r"^Args:\s*\n((?:[ \t]+.*\n?)+)", doc, re.MULTILINE)
    if not match:
        return {}
    return dict(re.findall(r"^[ \t]+(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", match.group(1), re.MULTILINE))


def spec_from_schema(schema: Any, function: str, where: str) -> ToolSpec:
    """A :class:`ToolSpec` from an OpenAI schema (the whole object or its ``function`` part)."""
    inner = schema.get("function", schema) if isinstance(schema, dict) else None
    if not isinstance(inner, dict) or not isinstance(inner.get("name"), str) or not inner["name"]:
        raise ToolError(f"{where}: the tool schema needs function.name (got {schema!r:.80})")
    parameters = inner.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ToolError(f"{where}: tool {inner['name']!r}: parameters must be a JSON schema of type object")
    _check_schema(parameters, f"{where}: tool {inner['name']!r}")
    return ToolSpec(inner["name"], str(inner.get("description", "")), parameters, function)


def _check_schema(parameters: dict[str, Any], where: str) -> None:
    import jsonschema

    try:
        jsonschema.validators.validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as err:
        raise ToolError(f"{where}: parameters is not a valid JSON schema: {err.message}") from None


def _from_function(spec: str) -> ToolSpec:
    fn = load_function(spec)
    schema = getattr(fn, "tool_schema", None)
    return spec_from_schema(schema if schema is not None else signature_schema(fn, spec), spec, spec)


def _from_yaml(path: str) -> list[ToolSpec]:
    import yaml

    if not os.path.isfile(path):
        raise ToolError(f"rollout.multi_turn.tools: {path} does not exist")
    with open(path) as f:
        try:
            loaded = yaml.safe_load(f)
        except yaml.YAMLError as err:
            raise ToolError(f"{path}: not YAML ({str(err).splitlines()[0]})") from None
    entries = loaded.get("tools") if isinstance(loaded, dict) else None
    if not isinstance(entries, list):
        raise ToolError(f"{path}: expected a mapping with a 'tools' list")
    specs = []
    for i, entry in enumerate(entries):
        where = f"{path} tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("function"), str):
            hint = (
                " (verl's class_name tools are classes; here a tool is a function)"
                if isinstance(entry, dict) and "class_name" in entry
                else ""
            )
            raise ToolError(f"{where}: needs function: module:function or path/to/file.py:function{hint}")
        function = entry["function"]
        target = function.rpartition(":")[0]
        if target.endswith(".py") and not os.path.isabs(target):  # relative to the YAML file
            function = os.path.join(os.path.dirname(os.path.abspath(path)), function)
        load_function(function)  # fails here, naming the entry, rather than in a worker
        if "tool_schema" in entry:
            specs.append(spec_from_schema(entry["tool_schema"], function, where))
        else:
            specs.append(_from_function(function))
    return specs


def load_tools(entries: Sequence[str]) -> list[ToolSpec]:
    """The tools ``rollout.multi_turn.tools`` names, in order; refuses two with one name."""
    specs: list[ToolSpec] = []
    for entry in entries:
        is_yaml = entry.endswith((".yaml", ".yml")) and ":" not in os.path.basename(entry)
        specs += _from_yaml(entry) if is_yaml else [_from_function(entry)]
    names = [s.name for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ToolError(f"rollout.multi_turn.tools: more than one tool is named {', '.join(twice)}")
    return specs


def check_arguments(spec: ToolSpec, arguments: Any) -> str | None:
    """None when ``arguments`` fit the tool's schema, else the message the model reads."""
    import jsonschema

    if not isinstance(arguments, dict):
        return f"arguments of {spec.name} must be a JSON object, got {type(arguments).__name__}"
    try:
        jsonschema.validate(arguments, spec.parameters)
    except jsonschema.ValidationError as err:
        at = "/".join(str(p) for p in err.absolute_path)
        return f"wrong arguments for {spec.name}{' at ' + at if at else ''}: {err.message}"
    return None


def as_answer(value: Any, name: str) -> tuple[str, float]:
    """A tool function's return value as ``(text, reward)``; raises TypeError for anything else."""
    reward: Any = 0.0
    if isinstance(value, tuple) and len(value) == 2:
        value, reward = value
    elif isinstance(value, dict) and "text" in value:
        value, reward = value["text"], value.get("reward", 0.0)
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise TypeError(
            f"{name} returned {value!r:.60}: expected text, (text, reward) or {{'text', 'reward'}}"
        )
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise TypeError(f"{name} returned the reward {reward!r:.60}, not a number")
    # a NaN or infinite reward (0/0 in numpy raises nothing) would make its whole GRPO group's advantages
    # and the loss non-finite: refused like any other non-answer (a tool error), as a scorer's NaN is
    if not math.isfinite(reward):
        raise TypeError(f"{name} returned the reward {reward}, not a finite number")
    return str(value), float(reward)
