"""Config sections check their own fields when built, naming the dotted key (``io/fields.py``), from Python
as from a recipe; the loader renames a shared section to where it sits (``sft.optim``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
from omegaconf import OmegaConf

from mcore_rl.config import (
    ConfigError,
    DataConfig,
    OptimConfig,
    ParallelConfig,
    check_config,
    schema_node,
)
from mcore_rl.io.errors import InputError
from mcore_rl.io.fields import POSITIVE, FieldError, check_section, one_of


@dataclass
class _Section:
    SECTION: ClassVar[str] = "demo"

    count: int = 1
    rate: float = 0.5
    name: str | None = None
    ids: list[int] | None = None
    mode: str = "a"

    def __post_init__(self) -> None:
        check_section(self, {"count": POSITIVE, "mode": one_of("a", "b")})


def test_types_and_rules_are_checked_at_construction_naming_the_dotted_key() -> None:
    _Section(count=3, rate=1, name="x", ids=[1, 2], mode="b")  # an int is a fine float
    with pytest.raises(FieldError) as info:
        _Section(count="4", rate="fast", ids=[1, "2"], mode="c")  # type: ignore[arg-type]
    assert info.value.problems == [
        ("demo.count", "='4' must be an integer"),
        ("demo.rate", "='fast' must be a number"),
        ("demo.ids", "=[1, '2'] must be a list of integers"),
        ("demo.mode", "='c' is not allowed; choose one of: a, b"),
    ]
    with pytest.raises(FieldError, match=r"demo\.count=0 must be > 0"):
        _Section(count=0)
    with pytest.raises(FieldError, match=r"demo\.count=True must be an integer"):
        _Section(count=True)
    assert isinstance(info.value, InputError)  # the CLI reports it as the user's error, in one line


def test_an_interpolation_waits_until_it_is_resolved() -> None:
    """A default that follows another key is a ``${...}`` string until OmegaConf resolves it: checked as an
    integer then, every such default would be refused; the section the loader builds from the resolved values
    (``config/loader.py``: ``to_container(resolve=True)``, then the class) is checked."""
    waiting = _Section(count="${other.count}")  # type: ignore[arg-type]
    assert waiting.count == "${other.count}"  # kept as written, unchecked
    node = OmegaConf.create({"other": {"count": 0}, "demo": {"count": "${other.count}"}})
    resolved = OmegaConf.to_container(node, resolve=True)
    assert isinstance(resolved, dict)
    with pytest.raises(FieldError, match=r"demo\.count=0 must be > 0"):
        _Section(**resolved["demo"])


def test_sections_built_in_python_name_their_field() -> None:
    with pytest.raises(FieldError, match=r"data\.train_batch_size='4' must be an integer"):
        DataConfig(train_batch_size="4")  # type: ignore[arg-type]
    with pytest.raises(FieldError, match=r"optim\.lr=-1 must be >= 0"):
        OptimConfig(lr=-1)
    with pytest.raises(
        FieldError, match=r"parallel\.backend='mpi' is not allowed; choose one of: null, nccl, gloo"
    ):
        ParallelConfig(backend="mpi")


def test_the_loader_names_a_shared_section_where_it_sits_and_reports_every_bad_field() -> None:
    node = {"sft": {"optim": {"lr": -2.0}}, "critic": {"optim": {"adam_beta1": 1.5}}}
    merged = OmegaConf.merge(schema_node(), OmegaConf.create(node))
    with pytest.raises(ConfigError) as info:
        check_config(merged)
    message = str(info.value)
    assert (
        "sft.optim.lr=-2.0 must be >= 0" in message
        and "critic.optim.adam_beta1=1.5 must be in [0, 1)" in message
    )
