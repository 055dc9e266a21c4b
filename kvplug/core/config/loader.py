"""Assembling ``KVPlugConfig`` from its layers, remembering where each value came from.

Later layers win: defaults < YAML file (``KVPLUG_CONFIG`` or ``config_file=``) <
``KVPLUG_*`` environment < the engine's extra config (``kvplug.``-prefixed keys or
a nested ``kvplug`` mapping) < per-request overrides.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvplug.core.concerns import CONFIG_CONCERNS
from kvplug.core.config.entries import component_slots, resolve_components
from kvplug.core.config.layers import (
    ENGINE_KEY_PREFIX,
    ENV_PREFIX,
    adapter_environment,
    deep_copy,
    engine_config_layer,
    env_layer,
    items_phrase,
)
from kvplug.core.config.model import KVPlugConfig
from kvplug.core.config.problems import problems_from_validation_error
from kvplug.core.config.yaml_layer import read_yaml_layer_lines
from kvplug.core.plugins import PluginRegistry, get_registry
from kvplug.core.records.integrity import integrity_key
from kvplug.core.tenancy import anchor_pin_files
from kvplug.errors import ConfigError, ConfigProblem


@dataclass
class LoadedConfig:
    """A resolved config and, per top-level key, the layer that set it."""

    config: KVPlugConfig
    sources: dict[str, str] = field(default_factory=dict)
    layers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


def load_config(
    *,
    config_file: str | os.PathLike[str] | None = None,
    engine_extra: Mapping[str, Any] | None = None,
    request: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    registry: PluginRegistry | None = None,
) -> LoadedConfig:
    """Merge the layers, validate, and resolve every component entry."""
    env = os.environ if env is None else env
    # The integrity key is process-wide (records are framed far from any config): an
    # unusable key setting is reported with the config, not on the first record.
    integrity_key()
    engine_layer, engine_file = engine_config_layer(engine_extra or {})
    layers: list[tuple[str, dict[str, Any]]] = []
    path = engine_file or config_file or env.get("KVPLUG_CONFIG")
    lines: dict[str, int] = {}
    if path:
        file_layer, lines = read_yaml_layer_lines(path)
        layers.append((f"file {path}", anchor_pin_files(file_layer, Path(path).parent)))
    names: dict[str, str] = {}  # (for errors: the variable as set, kvplug_chunk_size or KVPLUG_TIERS__00__X)
    layers.append(("env", env_layer(env, reserved=adapter_environment(registry or get_registry()), names=names)))
    layers.append(("engine", engine_layer))
    data: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, layer in layers:
        _merge(data, layer, sources, name)
    try:
        config = _validated(data, registry)
    except ConfigError as exc:
        if type(exc) is not ConfigError:
            raise
        named = set(sources.values())
        if named == {f"file {path}"}:
            # The file set everything: the error names it, and each problem its line
            # (`kvplug config validate` said "store.queue.mode: ..." with no word of where).
            raise ConfigError([_naming_line(p, lines) for p in exc.problems], str(path)) from None
        if named <= {"engine"}:  # the engine's config alone (the defaults are valid): it is the one given
            raise
        # The environment alone is named too: a variable left set in a shell (KVPLUG_CHUNK_SIZE=abc,
        # no file) is no more in sight than one beside a file.
        raise ConfigError([_naming_source(p, sources, lines, names) for p in exc.problems], exc.source) from None
    if request:
        config = config.with_overrides(request)
        for key in request:
            sources[key] = "request"
        layers.append(("request", dict(request)))
    return LoadedConfig(config, sources, layers)


def _validated(data: dict[str, Any], registry: PluginRegistry | None) -> KVPlugConfig:
    try:
        config = KVPlugConfig.model_validate(data)
    except ValidationError as exc:
        # One pass: the component entries that are well formed are checked too, so a
        # user fixes every problem at once rather than one layer of them per run.
        problems = problems_from_validation_error(exc, data, model=KVPlugConfig)
        resolve_components(_component_entries(data), registry or get_registry(), problems)
        raise ConfigError(problems) from None
    return config.resolve(registry)


def _naming_source(
    problem: ConfigProblem, sources: Mapping[str, str], lines: Mapping[str, int], names: Mapping[str, str]
) -> ConfigProblem:
    """``problem`` with the layer that set its value (a file and its line, a ``KVPLUG_``
    variable, the engine's config): a file may be right and a forgotten variable override it."""
    parts = problem.path.replace("[", ".").replace("]", "").split(".")
    for end in range(len(parts), 0, -1):
        layer = sources.get(".".join(parts[:end]))
        if layer is not None:
            break
    else:
        return problem
    if layer == "env":  # the variable that set it: the deepest one above it (KVPLUG_STORE='{...}')
        given = (names.get(".".join(parts[:n])) for n in range(end, 0, -1))
        layer = "env " + next((name for name in given if name), ENV_PREFIX + "__".join(parts[:end]).upper())
    elif layer == "engine":
        layer = "the engine's config, " + ENGINE_KEY_PREFIX + ".".join(parts[:end])
    elif _line(problem, lines) is not None:
        layer += f", line {_line(problem, lines)}"
    return ConfigProblem(problem.path, problem.value, f"{problem.message}; set in {layer}")


def _naming_line(problem: ConfigProblem, lines: Mapping[str, int]) -> ConfigProblem:
    line = _line(problem, lines)
    return problem if line is None else ConfigProblem(problem.path, problem.value, f"{problem.message}; line {line}")


def _line(problem: ConfigProblem, lines: Mapping[str, int]) -> int | None:
    """The config file's line of the deepest key of ``problem``'s path that the file has
    (``[1]``: a key that is no text, ``1:``, at the top level)."""
    parts = problem.path.replace("[", ".").replace("]", "").removeprefix(".").split(".")
    return next((lines[key] for n in range(len(parts), 0, -1) if (key := ".".join(parts[:n])) in lines), None)


def _component_entries(data: Mapping[str, Any]) -> list[tuple[str, str, str, dict[str, Any]]]:
    """``(path, concern, type, options)`` of the well-formed component entries of raw config data."""
    raw: list[Any] = []
    many: list[Any] = []  # the entries of the one list field (tiers)
    for concern in CONFIG_CONCERNS:
        value = data.get(str(concern.config_field))
        if concern.many:
            many = value if isinstance(value, list) else []
            raw.extend(many)
        else:
            raw.append(value)
    entries = []
    for (path, concern_key), entry in zip(component_slots(len(many)), raw):
        if isinstance(entry, Mapping) and isinstance(entry.get("type"), str) and entry["type"]:
            entries.append((path, concern_key, entry["type"], {k: v for k, v in entry.items() if k != "type"}))
    return entries


def _merge(
    into: dict[str, Any], layer: Mapping[str, Any], sources: dict[str, str], name: str, prefix: str = ""
) -> None:
    for key, value in layer.items():
        path = f"{prefix}{key}"
        # Sections merge key by key; a component spec naming a type ({type: ...}) is replaced
        # whole, since options of one type mean nothing to another. Options alone
        # (KVPLUG_SERIALIZER__LEVEL=5) are for the type an earlier layer chose: replacing its
        # spec with them lost the type ("serializer.type: Field required").
        whole = prefix == "" and key in ("serializer", "connector") and isinstance(value, Mapping) and "type" in value
        if isinstance(value, Mapping) and value and all(isinstance(index, int) for index in value):
            _merge_items(into, key, value, sources, name, path)
        elif isinstance(value, Mapping) and not whole:
            if not isinstance(into.get(key), dict):
                into[key] = {}
            _merge(into[key], value, sources, name, path + ".")
        else:
            into[key] = deep_copy(value)
            _credit(sources, path, name)


def _merge_items(
    into: dict[str, Any], key: str, items: Mapping[int, Any], sources: dict[str, str], name: str, path: str
) -> None:
    """Items a layer sets by index (``KVPLUG_TIERS__0__MAX_BYTES``) in the list an earlier layer gave."""
    target = into.get(key)
    for index, value in items.items():
        where = f"{path}.{index}"
        if not isinstance(target, list) or index >= len(target):
            have = (
                items_phrase(len(target))
                if isinstance(target, list)
                else "not a list an earlier layer (a config file) gave"
            )
            problem = f"sets item {index} of {path}, which is {have}: give the whole list instead"
            names = _leaf_paths(value, where)
            shown = (
                ", ".join("env " + ENV_PREFIX + n.upper().replace(".", "__") for n in names) if name == "env" else where
            )
            raise ConfigError([ConfigProblem(shown, value, problem)], "environment" if name == "env" else name)
        if isinstance(value, Mapping) and isinstance(target[index], dict):
            _merge(target[index], value, sources, name, where + ".")
        else:
            target[index] = deep_copy(value)
            _credit(sources, where, name)


def _credit(sources: dict[str, str], path: str, name: str) -> None:
    """Layer ``name`` set the value at ``path`` whole: the parts an earlier layer set below it
    are gone with it (``config show`` and errors credited them to that layer still)."""
    for stale in [key for key in sources if key.startswith(path + ".")]:
        del sources[stale]
    sources[path] = name


def _leaf_paths(value: Any, path: str) -> list[str]:
    if isinstance(value, Mapping) and value:
        return [leaf for key, child in value.items() for leaf in _leaf_paths(child, f"{path}.{key}")]
    return [path]
