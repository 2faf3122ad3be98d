"""YAML recipes and ``key=value`` overrides into a checked :class:`~mcore_rl.config.run.RunConfig`.

OmegaConf does the merging, typing and interpolation (``${data.max_response_length}``); this module adds
what a user needs around it:

* ``defaults:`` in a recipe lists parent recipes (paths relative to the recipe, ``.yaml`` optional) merged
  first, in order; ``_self_`` in the list places the recipe itself (last by default). Cycles are refused.
* a bare recipe name (``base``, ``demo_cpu``: no folder part), as a parent or on the command line, that is
  not found where it is looked for (next to the recipe naming it, or the working directory) is one of the
  project's own recipes (:func:`project_recipes`), so ``defaults: [base]`` works from any folder.
* a section left empty (``reward:`` with nothing under it: YAML's null) is the section's defaults.
* one-line errors: an unknown key names its full dotted path, where it came from and the keys allowed
  there; a wrong type names the key, the expected type and the value; then :func:`validate` runs.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mcore_rl.config.fast_paths import resolve_fast_paths
from mcore_rl.config.key_hints import key_hint
from mcore_rl.config.machine import resolve_ranks_per_node
from mcore_rl.config.run import RunConfig
from mcore_rl.config.validate import problems_message, validate
from mcore_rl.io.errors import ConfigError
from mcore_rl.io.fields import FieldError

CONFIG_FILE = "config.yaml"
"""Name of the resolved config written next to a run's outputs and inside each checkpoint."""


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    check_paths: bool = False,
    rules: bool = True,
    max_ranks: int | None = None,
) -> RunConfig:
    """The run config of recipe ``path`` (None: the schema defaults) with ``key=value`` ``overrides``
    applied in order, resolved and validated (see :func:`validate`; ``check_paths`` also requires files).
    ``rules=False`` checks each field (unknown keys, types, ranges) but not the rules that span sections
    (:func:`~mcore_rl.config.validate.config_problems`): ``config show`` prints a config that cannot run.
    ``max_ranks`` bounds an automatic ``trainer.n_gpus_per_node`` (:mod:`mcore_rl.config.machine`) and refuses
    a larger world: 1 for a run in this process."""
    layers = _recipe_chain(_find_recipe(Path(path), None), ()) if path is not None else []
    layers.append(("overrides", _parse_overrides(overrides)))
    problems: list[str] = []
    for source, layer in layers:  # every layer's unknown keys at once: a verl command has dozens
        _drop_null_sections(layer, RunConfig)  # before the key check: null is not "a section expected"
        _lists_from_scalars(layer, RunConfig)
        _check_keys(OmegaConf.to_container(layer, resolve=False), RunConfig, "", source, problems)
    if len(problems) > 1:
        raise ConfigError(f"{len(problems)} keys refused:\n  " + ";\n  ".join(problems))
    if problems:
        raise ConfigError(problems[0])
    return check_config(_merge(layers), check_paths=check_paths, rules=rules, max_ranks=max_ranks)


def check_config(
    cfg: RunConfig | DictConfig,
    check_paths: bool = False,
    rules: bool = True,
    max_ranks: int | None = None,
) -> RunConfig:
    """A resolved, type-checked and validated copy of ``cfg`` (e.g. one built in Python): interpolations
    such as ``rollout.response_length`` take their values, an automatic ``trainer.n_gpus_per_node`` its count
    on this machine (at most ``max_ranks``), wrong types and broken rules raise ConfigError (the rules that
    span sections only with ``rules``)."""
    try:
        node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
        values = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as err:
        raise ConfigError(_reword(err, "config")) from None
    problems: list[str] = []
    resolved = _build(RunConfig, values, "", problems)
    if resolved is None:
        raise ConfigError(problems_message(problems))
    assert isinstance(resolved, RunConfig)
    resolved = resolve_ranks_per_node(resolved, max_ranks)
    if max_ranks is not None and resolved.world_size > max_ranks:  # before the run folder is claimed
        raise ConfigError(
            f"trainer.n_gpus_per_node x trainer.nnodes = {resolved.world_size} ranks, but a run in this process "
            f"(--in-process) has {max_ranks}: drop --in-process, or set trainer.n_gpus_per_node={max_ranks}"
        )
    if rules:
        validate(resolved, check_paths=check_paths)
        resolved = resolve_fast_paths(resolved)  # the run logs what they do (describe_fast_paths)
    return resolved


def _build(schema: type, values: Any, prefix: str, problems: list[str]) -> Any:
    """``schema(**values)`` with its nested sections built first, each named by its dotted key: a section's
    own field checks raise naming its ``SECTION``, renamed here to where it sits (``sft.optim``). Bad fields
    go to ``problems`` (every section is tried, so all are reported at once); None when any was bad."""
    hints = _type_hints(schema)
    kwargs, complete = {}, True
    for f in dataclasses.fields(schema):
        if not f.init or f.name not in values:
            continue
        value, section = values[f.name], _section_type(hints[f.name])
        if section is not None and isinstance(value, Mapping):
            value = _build(section, value, f"{prefix}{f.name}.", problems)
            complete = complete and value is not None
        kwargs[f.name] = value
    if not complete:
        return None
    try:
        return schema(**kwargs)
    except FieldError as err:
        own = getattr(schema, "SECTION", schema.__name__)
        problems += [f"{prefix}{key[len(own) + 1 :]}{message}" for key, message in err.problems]
        return None


def _section_type(hint: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), or None for a plain value."""
    options = [hint, *typing.get_args(hint)]
    return next((o for o in options if dataclasses.is_dataclass(o) and isinstance(o, type)), None)


def config_to_yaml(cfg: RunConfig) -> str:
    """The config as YAML, every key written out (interpolations already resolved)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def save_config(cfg: RunConfig, folder: str | os.PathLike[str]) -> Path:
    """Write ``folder/config.yaml`` (atomically: a partial file is never left under the final name)."""
    os.makedirs(folder, exist_ok=True)
    target = Path(folder) / CONFIG_FILE
    staging = target.with_suffix(".yaml.tmp")
    staging.write_text(config_to_yaml(cfg))
    os.replace(staging, target)
    return target


def project_recipes() -> Path | None:
    """The project's own recipes folder: ``mcore_rl/recipes/`` in an installed wheel (``setup.py`` ships
    the repository's ``recipes/*.yaml`` there), the repository's ``recipes/`` in a source checkout or an
    editable install; None when neither is there."""
    package = Path(__file__).resolve().parents[1]
    if (package / "recipes").is_dir():
        return package / "recipes"
    checkout = package.parent  # a source tree: setup.py beside the package (not any site-packages/recipes)
    if (checkout / "setup.py").is_file() and (checkout / "recipes").is_dir():
        return checkout / "recipes"
    return None


def _find_recipe(path: Path, folder: Path | None) -> Path:
    """Recipe ``path`` (``.yaml`` optional) as given, relative to ``folder`` (the recipe naming it as a
    parent; None: the working directory); a bare name found nowhere there is one of :func:`project_recipes`.
    Returned unresolved when missing, so the error names what was written."""

    def with_suffix(p: Path) -> Path:
        # a name's own dots stay (``llama3.1_8b``: Path.with_suffix would make it llama3.yaml)
        return p if p.suffix in (".yaml", ".yml") or p.is_file() else p.with_name(p.name + ".yaml")

    local = with_suffix(path if folder is None else folder / path)
    own = project_recipes()
    if local.is_file() or len(path.parts) != 1 or own is None:
        return local
    installed = with_suffix(own / path)
    return installed if installed.is_file() else local


def _recipe_chain(path: Path, seen: tuple[Path, ...]) -> list[tuple[str, DictConfig]]:
    """``(source, layer)`` pairs of ``path`` and its ``defaults:`` parents, in merge order."""
    resolved = path.resolve()
    if resolved in seen:
        cycle = " -> ".join(str(p) for p in (*seen, resolved))
        raise ConfigError(f"{path}: defaults form a cycle ({cycle})")
    try:
        layer = OmegaConf.load(path)
    except FileNotFoundError:
        parent = f" (listed in defaults of {seen[-1]})" if seen else ""
        own = project_recipes()
        known = sorted(p.stem for p in own.glob("*.yaml")) if own is not None else []
        listed = f"; the project's own recipes, by bare name: {', '.join(known)}" if known else ""
        raise ConfigError(f"{path}: recipe not found{parent}{listed}") from None
    except Exception as err:  # yaml's scanner errors name the line and column
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(layer, DictConfig):
        raise ConfigError(f"{path}: a recipe must be a mapping of sections, got a list")
    defaults = layer.pop("defaults", [])
    if not isinstance(defaults, ListConfig | list):
        raise ConfigError(f"{path}: defaults must be a list of recipe paths, got {defaults!r}")
    names = [str(d) for d in defaults]
    if "_self_" not in names:
        names.append("_self_")
    chain: list[tuple[str, DictConfig]] = []
    for name in names:
        if name == "_self_":
            chain.append((str(path), layer))
        else:
            chain += _recipe_chain(_find_recipe(Path(name), path.parent), (*seen, resolved))
    return chain


def _parse_overrides(overrides: Sequence[str]) -> DictConfig:
    """``key=value`` items into one layer. Hydra's ``+key=value`` and ``++key=value`` (verl's scripts add keys
    their YAML lacks that way) are ``key=value`` here: every key exists in the schema, or is named unknown."""
    merged = OmegaConf.create({})
    for given in overrides:
        item = given[2:] if given.startswith("++") else given[1:] if given.startswith("+") else given
        key = item.split("=", 1)[0]
        if key.startswith("~"):
            raise ConfigError(
                f"override {given!r}: a key cannot be removed (Hydra's ~); set it to the value wanted"
            )
        if "=" not in item or not key or key.startswith("+"):
            raise ConfigError(f"override {given!r} is not of the form dotted.key=value")
        try:  # one at a time, so a value YAML cannot parse is named
            merged.merge_with(OmegaConf.from_dotlist([item]))
        except (OmegaConfBaseException, yaml.YAMLError) as err:
            raise ConfigError(f"override {item!r}: {_first_line(err)}") from None
    return merged


@functools.cache
def schema_node() -> DictConfig:
    """The schema's defaults as a typed OmegaConf node, built once per process (a tenth of a second each
    time: most of a config load). Merge onto it (``OmegaConf.merge`` copies it); never change it in place."""
    return OmegaConf.structured(RunConfig)


@functools.cache
def _type_hints(schema: type) -> dict[str, Any]:
    return typing.get_type_hints(schema)


def _merge(layers: list[tuple[str, DictConfig]]) -> DictConfig:
    """The schema with ``layers`` merged in order, in one merge (each merge copies the whole config); when it
    fails, layer by layer, to name the layer whose value it refused."""
    try:
        merged = OmegaConf.merge(schema_node(), *(layer for _, layer in layers))
    except OmegaConfBaseException:
        merged = schema_node()
        for source, layer in layers:
            try:
                merged = OmegaConf.merge(merged, layer)
            except OmegaConfBaseException as err:
                raise ConfigError(_reword(err, source)) from None
    assert isinstance(merged, DictConfig)
    return merged


def _drop_null_sections(layer: DictConfig, schema: type) -> None:
    """Remove every section given as null (``reward:`` with nothing under it), at any depth, so that it keeps
    its defaults; a field that may itself be None (``critic.parallel: null``) keeps its null."""
    raw = OmegaConf.to_container(layer, resolve=False)  # unresolved: a ${...} elsewhere may not resolve yet
    assert isinstance(raw, dict)
    hints = _type_hints(schema)
    for key, value in raw.items():
        hint = hints.get(str(key))
        if not (dataclasses.is_dataclass(hint) and isinstance(hint, type)):
            continue  # an unknown key (named by _check_keys), a plain value or an optional section
        if value is None:
            del layer[key]
        elif isinstance(value, Mapping):
            _drop_null_sections(layer[key], hint)


def _check_keys(raw: Any, schema: type, prefix: str, source: str, problems: list[str]) -> None:
    """Unknown keys and a scalar given for a section, named by full dotted key, into ``problems`` before
    OmegaConf sees them (its own message does not say which file, and a scalar-for-section error names no
    key at all)."""
    if not isinstance(raw, Mapping):
        problems.append(
            f"{prefix.rstrip('.') or 'config'}: expected a section (mapping), got {raw!r} ({source})"
        )
        return
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = _type_hints(schema)
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        if key not in fields:
            for leaf in _leaves(dotted, value):  # verl's actor_rollout_ref.* keys, each with its own hint
                # the keys allowed there only when nothing is close: a hint says it in fewer words
                hint = key_hint(RunConfig, leaf, list(fields), prefix) or (
                    f"; keys allowed under {prefix.rstrip('.') or 'the root'}: {', '.join(fields)}"
                )
                problems.append(f"unknown key {leaf} ({source}){hint}")
            continue
        hint = hints[key]
        if dataclasses.is_dataclass(hint) and isinstance(hint, type):
            _check_keys(value, hint, f"{dotted}.", source, problems)


def _lists_from_scalars(layer: DictConfig, schema: type) -> None:
    """A single value given where the schema holds a list is that one-element list, and null the empty
    list: verl's scripts pass ``data.train_files=~/data/gsm8k/train.parquet`` (verl's loader wraps a single
    path), and OmegaConf's own refusal names no form that works."""
    hints = _type_hints(schema)
    raw = OmegaConf.to_container(layer, resolve=False)
    assert isinstance(raw, dict)
    for key, value in raw.items():
        hint = hints.get(str(key))
        section = _section_type(hint) if hint is not None else None
        if section is not None and isinstance(value, Mapping):
            _lists_from_scalars(layer[key], section)
        elif typing.get_origin(hint) is list and not isinstance(value, list | Mapping):
            if isinstance(value, str) and value.startswith("${"):
                continue  # an interpolation: resolved later, checked as a list then
            layer[key] = [] if value is None else [value]


def _leaves(dotted: str, value: Any) -> list[str]:
    """The full key of every value under ``dotted`` (``actor_rollout_ref`` -> ``..model.path``, ...)."""
    if not isinstance(value, Mapping) or not value:
        return [dotted]
    return [leaf for key, inner in value.items() for leaf in _leaves(f"{dotted}.{key}", inner)]


def _expected(full_key: str) -> str:
    """The schema type of ``full_key`` as text, e.g. ``int | None``, and its allowed values if a choice."""
    schema: Any = RunConfig
    hint: Any = None
    for part in full_key.split("."):
        if not (dataclasses.is_dataclass(schema) and isinstance(schema, type)):
            return "a value"
        hint = _type_hints(schema).get(part)
        schema = hint
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _first_line(err: Exception) -> str:
    return str(err).split("\n", 1)[0]


def _reword(err: OmegaConfBaseException, source: str) -> str:
    key = getattr(err, "full_key", None)
    if not key:
        return f"{source}: {_first_line(err)}"
    return f"{key}: {_first_line(err)}; expected {_expected(key)} ({source})"
