"""Field checks of config sections, run where each section is constructed (its ``__post_init__``).

Every section dataclass (``ParallelConfig``, ``OptimConfig``, ``DataConfig``, ...) checks its own fields:
the type its annotation names (Python callers get no OmegaConf type check) and the rule beside the field
(a range, or a choice from one enum). A failure raises :class:`FieldError`, one line per bad field, named by
its dotted key. A section does not know where it sits in a run config (``optim``, ``sft.optim`` and
``critic.optim`` are one class), so it names itself by its ``SECTION``; the config loader, which does know,
renames the keys with :meth:`FieldError.under`.

Values that are still OmegaConf interpolations (``"${data.max_response_length}"``, a default that follows
another key) are not checked here: they are checked once resolved, when the loader builds the section.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mcore_rl.io.errors import InputError


@dataclass(frozen=True)
class Rule:
    """What a field must be: ``requirement`` in words, ``ok`` as a predicate."""

    requirement: str
    ok: Callable[[Any], bool]
    is_choice: bool = False
    """A list of allowed values (``requirement`` lists them) rather than a range."""

    def problem(self, value: Any) -> str:
        """What is wrong with ``value``, to follow the field's dotted key."""
        if self.is_choice:
            return f"={value!r} is not allowed; choose one of: {self.requirement}"
        return f"={value!r} must be {self.requirement}"


POSITIVE = Rule("> 0", lambda v: v > 0)
NON_NEGATIVE = Rule(">= 0", lambda v: v >= 0)
OPTIONAL_POSITIVE = Rule("> 0 or null", lambda v: v is None or v > 0)
OPTIONAL_NON_NEGATIVE = Rule(">= 0 or null", lambda v: v is None or v >= 0)
UNIT_INTERVAL = Rule("in [0, 1)", lambda v: 0 <= v < 1)
CLOSED_UNIT = Rule("in [0, 1]", lambda v: 0 <= v <= 1)
PROBABILITY = Rule("in (0, 1]", lambda v: 0 < v <= 1)
FREQUENCY = Rule("a positive step count or -1", lambda v: v == -1 or v > 0)


def choice(kind: type[enum.Enum], optional: bool = False) -> Rule:
    """One of ``kind``'s values (and null when ``optional``)."""
    values = [m.value for m in kind]
    shown = ", ".join([*(["null"] if optional else []), *map(str, values)])
    return Rule(shown, lambda v: (optional and v is None) or v in values, is_choice=True)


def one_of(*values: Any) -> Rule:
    """One of ``values`` (a short fixed list that no other code dispatches on)."""
    shown = ", ".join("null" if v is None else str(v) for v in values)
    return Rule(shown, lambda v: v in values, is_choice=True)


class FieldError(InputError):
    """Fields of one section (or a whole config) that break their rules, one ``(key, message)`` each."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{key}{message}" for key, message in problems))

    def under(self, section: str, own_section: str) -> FieldError:
        """The same problems named under ``section`` instead of the section's own name ``own_section``."""
        renamed = [(section + key[len(own_section) :], m) for key, m in self.problems]
        return FieldError(renamed)


def check_section(section: Any, rules: dict[str, Rule] | None = None) -> None:
    """Type-check every field of the dataclass ``section`` against its annotation, then apply ``rules``
    (field name -> rule) to the well-typed ones; raise :class:`FieldError` naming each bad field as
    ``<section.SECTION>.<field>``."""
    prefix = getattr(section, "SECTION", type(section).__name__)
    hints = _hints(type(section))
    problems = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if _is_interpolation(value):
            continue
        expected = _type_problem(value, hints.get(f.name, Any))
        if expected is not None:
            problems.append((f"{prefix}.{f.name}", f"={value!r} must be {expected}"))
            continue
        rule = (rules or {}).get(f.name)
        if rule is not None and not rule.ok(value):
            problems.append((f"{prefix}.{f.name}", rule.problem(value)))
    if problems:
        raise FieldError(problems)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except NameError:  # an annotation only importable for type checkers: check the rules alone
        return {}


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and value.startswith("${")


def _type_problem(value: Any, hint: Any) -> str | None:
    """None when ``value`` fits ``hint``; else what it should have been, in words."""
    if hint is Any or dataclasses.is_dataclass(hint):
        return None  # nested sections check themselves
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        problems = [_type_problem(value, o) for o in options if o is not type(None)]
        return None if None in problems else " or ".join(p for p in problems if p)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return "a list"
        (item,) = typing.get_args(hint)[:1] or (Any,)
        bad = next((p for p in (_type_problem(v, item) for v in value) if p), None)
        return None if bad is None else f"a list of {bad.removeprefix('a ').removeprefix('an ')}s"
    if origin is dict:
        return None if isinstance(value, dict) else "a mapping"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    return None
