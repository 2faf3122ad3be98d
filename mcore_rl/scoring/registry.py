"""Which scorer answers which row: verl's ``default_compute_score`` table by ``data_source``, the recipe's
``reward.sources`` entries on top, or one ``reward.custom_function`` for everything.

A scorer has verl's signature ``fn(data_source, solution_str, ground_truth, extra_info) -> float | dict``
(a dict carries ``score`` plus extra metrics). User scorers are named ``module:function`` (importable) or
``path/to/file.py:function`` (loaded from the file).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import re
import sys
from collections.abc import Callable
from typing import Any

from mcore_rl.io.errors import InputError
from mcore_rl.scoring import rules
from mcore_rl.scoring.config import RewardConfig

ScoreFn = Callable[[str, str, Any, dict[str, Any]], "float | dict[str, Any]"]

DEMO_DATA_SOURCE = "mcore_rl/arithmetic"
"""The arithmetic demo task's rows (:mod:`mcore_rl.data.demo_task`); exact match."""
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
"""verl's ``math_dapo`` sources (``aime*`` too): answers on an ``Answer:`` line, not in ``\\boxed{}``."""
BUILTIN_NAMES = ("gsm8k", "math", "math_dapo", "exact_match", "format")


class ScorerError(InputError):
    """A scorer spec or data source we cannot resolve; the message names the spec or source."""


def truth_text(truth: Any) -> str:
    """A ground truth as the text rules compare answers with: an integer-valued float as the integer (a
    numeric parquet column with any NaN is float64, ``72.0``, where the model writes ``72``)."""
    if isinstance(truth, float) and truth.is_integer():
        return str(int(truth))
    return str(truth)


def builtin_scorer(name: str, cfg: RewardConfig) -> ScoreFn:
    """One of :data:`BUILTIN_NAMES`, with the recipe's GSM8K method and format score bound."""

    def gsm8k(data_source: str, solution: str, truth: Any, extra: dict[str, Any]) -> float:
        return rules.gsm8k_score(solution, truth_text(truth), cfg.gsm8k_method, cfg.format_score)

    def math(data_source: str, solution: str, truth: Any, extra: dict[str, Any]) -> float:
        return rules.math_score(solution, truth_text(truth), cfg.format_score)

    def math_dapo(data_source: str, solution: str, truth: Any, extra: dict[str, Any]) -> float:
        return rules.dapo_score(solution, truth_text(truth))

    def exact_match(data_source: str, solution: str, truth: Any, extra: dict[str, Any]) -> float:
        return rules.exact_match_score(solution, truth_text(truth))

    def format_check(data_source: str, solution: str, truth: Any, extra: dict[str, Any]) -> float:
        pattern = extra.get("format_pattern")
        if not isinstance(pattern, str):
            raise ScorerError("the format scorer needs extra_info.format_pattern (a regular expression)")
        return rules.format_score(solution, pattern)

    table: dict[str, ScoreFn] = {
        "gsm8k": gsm8k,
        "math": math,
        "math_dapo": math_dapo,
        "exact_match": exact_match,
        "format": format_check,
    }
    if name not in table:
        raise ScorerError(f"unknown built-in scorer {name!r}; built-ins: {', '.join(BUILTIN_NAMES)}")
    return table[name]


def default_scorer_name(data_source: str) -> str | None:
    """verl's dispatch for the rule-based sources, plus the demo task; None when unknown."""
    if data_source == "openai/gsm8k":
        return "gsm8k"
    if data_source in MATH_SOURCES:
        return "math"
    if data_source in DAPO_SOURCES or data_source.startswith("aime"):
        return "math_dapo"
    if data_source == DEMO_DATA_SOURCE:
        return "exact_match"
    return None


def builtin_sources() -> list[str]:
    """The ``data_source`` values with a built-in scorer (:func:`default_scorer_name`), ``*`` a prefix."""
    return ["openai/gsm8k", *MATH_SOURCES, *DAPO_SOURCES, "aime*", DEMO_DATA_SOURCE]


def has_scorer(data_source: str, cfg: RewardConfig) -> bool:
    """Whether :class:`ScoreDispatch` has a scorer for rows of ``data_source``: ``reward.custom_function``,
    a ``reward.sources`` entry, or a built-in (decided from the config, importing no user scorer)."""
    return (
        bool(cfg.custom_function)
        or data_source in cfg.sources
        or default_scorer_name(data_source) is not None
    )


def how_to_add_scorer(data_source: str) -> str:
    return (
        f"add reward.sources.{data_source}=<scorer> (a built-in of {', '.join(BUILTIN_NAMES)} or "
        "module:function or path/to/file.py:function) or reward.custom_function"
    )


def check_scorers(cfg: RewardConfig, sources: dict[str, str]) -> None:
    """Refuse data whose rows no scorer answers (each would score 0 under ``reward.on_error=zero``: a run that
    learns nothing); ``sources`` maps each ``data_source`` of the data to where a row of it is."""
    missing = [(s, where) for s, where in sources.items() if not has_scorer(s, cfg)]
    if missing:
        source, where = missing[0]
        others = f" (also {', '.join(repr(s) for s, _ in missing[1:])})" if missing[1:] else ""
        raise ScorerError(
            f"no scorer for data_source {source!r} ({where}){others}: {how_to_add_scorer(source)}; "
            f"the built-in scorers answer {', '.join(builtin_sources())}"
        )


def ground_truth_problem(cfg: RewardConfig, data_source: str, truth: Any) -> str | None:
    """What is wrong with a row's ``reward_model.ground_truth`` for the scorer of its ``data_source``, or None.
    The built-in rules compare the answer with the ground truth as text: a dict, a list or a boolean there would
    score every answer 0 without a word. A user scorer takes whatever its data holds."""
    name = _builtin_for(cfg, data_source)
    if name is None:
        return None
    if isinstance(truth, str):
        return f"empty, which the built-in scorer {name!r} never matches" if not truth.strip() else None
    if isinstance(truth, (int, float)) and not isinstance(truth, bool) and math.isfinite(truth):
        return None
    kind = type(truth).__name__
    return (
        f"is a {kind} ({truth!r:.60}); the built-in scorer {name!r} compares the answer with it as text: store "
        "the answer as a string, or score these rows with reward.custom_function"
    )


def row_problem(
    cfg: RewardConfig, data_source: str, truth: Any, extra_info: dict[str, Any]
) -> tuple[str, str] | None:
    """``(field, what is wrong)`` of a prompt row for the scorer of its ``data_source``, or None: the built-in
    ``format`` scorer reads ``extra_info.format_pattern`` (every answer of a row without one raised, scored 0)
    and no ground truth; the other built-ins the ground truth (:func:`ground_truth_problem`)."""
    if _builtin_for(cfg, data_source) == "format":
        pattern = extra_info.get("format_pattern")
        if not isinstance(pattern, str):
            return "extra_info.format_pattern", "missing: the format scorer matches each response against it"
        try:
            re.compile(pattern)
        except re.error as err:
            return "extra_info.format_pattern", f"not a regular expression ({err})"
        return None
    problem = ground_truth_problem(cfg, data_source, truth)
    return None if problem is None else ("reward_model.ground_truth", problem)


def _builtin_for(cfg: RewardConfig, data_source: str) -> str | None:
    """The built-in scorer that answers ``data_source`` (None: a user scorer, or none at all)."""
    if cfg.custom_function:
        return None
    if data_source in cfg.sources:
        spec = cfg.sources[data_source]
        return spec if spec in BUILTIN_NAMES else None
    return default_scorer_name(data_source)


def scorer_name(cfg: RewardConfig, data_source: str) -> str:
    """The config entry that scores ``data_source``, for messages."""
    if cfg.custom_function:
        return f"reward.custom_function={cfg.custom_function}"
    if data_source in cfg.sources:
        return f"reward.sources.{data_source}={cfg.sources[data_source]}"
    return f"the built-in scorer {default_scorer_name(data_source)!r}"


def check_signature(spec: str, fn: ScoreFn) -> None:
    """A user scorer must take verl's four arguments ``(data_source, solution_str, ground_truth, extra_info)``
    (checked before the first step, not at the first answer hours later)."""
    try:
        inspect.signature(fn).bind("data_source", "solution_str", "ground_truth", {})
    except TypeError as err:
        raise ScorerError(
            f"scorer {spec!r} cannot be called as fn(data_source, solution_str, ground_truth, extra_info): {err}"
        ) from None
    except ValueError:  # a builtin without a signature: it is called and judged by its answers
        return


def load_user_scorer(spec: str) -> ScoreFn:
    """``module:function`` or ``path/to/file.py:function``."""
    target, sep, name = spec.rpartition(":")
    if not sep or not target or not name:
        raise ScorerError(f"scorer {spec!r} must be 'module:function' or 'path/to/file.py:function'")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ScorerError(f"scorer {spec!r}: file {target} does not exist")
        module_name = f"_mcore_rl_user_scorer_{abs(hash(os.path.abspath(target)))}"
        loader_spec = importlib.util.spec_from_file_location(module_name, target)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as err:  # the user's file fails on import: name it, not our loader
            raise ScorerError(
                f"scorer {spec!r}: importing {target} failed ({type(err).__name__}: {err})"
            ) from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as err:
            raise ScorerError(f"scorer {spec!r}: cannot import {target} ({err})") from None
        except Exception as err:  # the user's module fails on import (a syntax error, a raise)
            raise ScorerError(
                f"scorer {spec!r}: importing {target} failed ({type(err).__name__}: {err})"
            ) from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ScorerError(f"scorer {spec!r}: {target} has no function {name!r}")
    check_signature(spec, fn)
    return fn


def resolve_scorer(spec: str, cfg: RewardConfig) -> ScoreFn:
    return builtin_scorer(spec, cfg) if spec in BUILTIN_NAMES else load_user_scorer(spec)


class ScoreDispatch:
    """``reward.custom_function`` for every row, else ``reward.sources`` then the built-in table."""

    def __init__(self, cfg: RewardConfig) -> None:
        self.cfg = cfg
        self._custom = load_user_scorer(cfg.custom_function) if cfg.custom_function else None
        self._by_source = {source: resolve_scorer(spec, cfg) for source, spec in cfg.sources.items()}

    def scorer_for(self, data_source: str) -> ScoreFn:
        if self._custom is not None:
            return self._custom
        if data_source not in self._by_source:
            name = default_scorer_name(data_source)
            if name is None:
                raise ScorerError(
                    f"no scorer for data_source {data_source!r}: {how_to_add_scorer(data_source)}"
                )
            self._by_source[data_source] = builtin_scorer(name, self.cfg)
        return self._by_source[data_source]

    def __call__(self, data_source: str, solution: str, truth: Any, extra: dict[str, Any]) -> Any:
        return self.scorer_for(data_source)(data_source, solution, truth, extra)
