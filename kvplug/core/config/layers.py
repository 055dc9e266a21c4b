"""The layers of a kvplug config, each read into a mapping: a YAML file, the ``KVPLUG_*``
environment, and an engine's extra config (the file's reader is
:mod:`kvplug.core.config.yaml_layer`; :mod:`kvplug.core.config.loader` merges and
validates them). Each refuses what it cannot read with an error naming where it is: a line of
the file, a variable, an engine key."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from kvplug.core.config.model import KVPlugConfig
from kvplug.core.config.problems import did_you_mean
from kvplug.core.config.yaml_layer import MAX_NESTING
from kvplug.core.control_socket import LOOKUP_DIR_ENV
from kvplug.core.plugins import PluginRegistry
from kvplug.core.records.integrity import INTEGRITY_KEY_ENV, INTEGRITY_KEY_FILE_ENV
from kvplug.errors import ConfigError, ConfigProblem

ENV_PREFIX = "KVPLUG_"
#: ``KVPLUG_*`` variables that are not config fields.
RESERVED_ENV = {
    "KVPLUG_CONFIG",
    "KVPLUG_PLUGINS",
    "KVPLUG_TRACE_PLUGINS",
    "KVPLUG_LOG_LEVEL",
    INTEGRITY_KEY_ENV,
    INTEGRITY_KEY_FILE_ENV,
    LOOKUP_DIR_ENV,  # the private socket folder (kvplug ctl, lookups)
}
RESERVED_ENV_PREFIXES = ("KVPLUG_TEST_", "KVPLUG_BENCH_")
ENGINE_KEY_PREFIX = "kvplug."


def adapter_environment(registry: PluginRegistry) -> frozenset[str]:
    """The ``KVPLUG_*`` variables installed engine adapters set for their engines (not settings)."""
    return frozenset(name.upper() for adapter in registry.engine_adapters().values() for name in adapter.environment)


def env_layer(
    env: Mapping[str, str], reserved: frozenset[str] = frozenset(), names: dict[str, str] | None = None
) -> dict[str, Any]:
    """``KVPLUG_CHUNK_SIZE=128``, ``KVPLUG_STORE__QUEUE__MODE=sync``, ``KVPLUG_TIERS='[...]'``,
    ``KVPLUG_TIERS__0__MAX_BYTES=8GiB`` (item 0 of the tiers list, from this layer or the file's).

    ``__`` separates keys, a number picks a list item; a value that starts with ``[`` or ``{``
    is JSON. Every ``KVPLUG_*`` variable applies or is an error naming it: an unknown
    setting, a part of a single value, an item a list does not have, JSON that does not
    parse. Unknown keys inside a section are the model's errors (``store.nope: unknown
    key``). ``reserved``: more names that are not settings (see :func:`adapter_environment`);
    ``names``, if given, gets the variable that set each dotted path (``tiers.0.max_bytes``)."""
    fields = {name.upper(): name for name in KVPlugConfig.model_fields}
    problems: list[ConfigProblem] = []
    layer: dict[str, Any] = {}
    settings = [
        name
        for name in env
        if name.upper().startswith(ENV_PREFIX)
        and name.upper() not in RESERVED_ENV
        and name.upper() not in reserved
        and not name.upper().startswith(RESERVED_ENV_PREFIXES)
    ]
    # Whole values before their parts: KVPLUG_TIERS sets the list that KVPLUG_TIERS__0__X changes.
    seen: dict[tuple[str | int, ...], str] = {}
    for name in sorted(settings, key=lambda n: (n.count("__"), n)):
        path = name.upper()[len(ENV_PREFIX) :].lower().split("__")
        problem = _env_name_problem(path, fields) or _given_twice(seen, _key_path(path), name)
        if problem is None:
            try:
                value = _env_value(env[name], ".".join(path))
                if len(path) == 1 and isinstance(value, str) and not _is_single_value(fields[path[0].upper()]):
                    raise ValueError(_needs_json(fields[path[0].upper()]))
                _set_path(layer, _key_path(path), value)
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            problems.append(ConfigProblem(f"env {name}", env[name], problem))
    if problems:
        raise ConfigError(problems, "environment")
    if names is not None:  # the variable that set each dotted path, as the user spelled it
        names.update((".".join(map(str, path)), name) for path, name in seen.items())
    return layer


def _env_name_problem(path: list[str], fields: Mapping[str, str]) -> str | None:
    if path[0].upper() not in fields:
        allowed = sorted(ENV_PREFIX + f for f in fields)
        return f"unknown setting; {did_you_mean(ENV_PREFIX + path[0].upper(), allowed)}allowed: {', '.join(allowed)}"
    if "" in path:
        return "an empty key between two '__'"
    if len(path) > 1 and _is_single_value(fields[path[0].upper()]):
        return f"{fields[path[0].upper()]} is a single value: it has no part {path[1]!r}"
    return None


def _needs_json(field_name: str) -> str:
    """Why plain text cannot set a list or a section (``KVPLUG_TIERS=cpu``): pydantic's "Input
    should be a valid list" named neither the variable nor the way to write one."""
    many = get_origin(KVPlugConfig.model_fields[field_name].annotation) is list
    variable = ENV_PREFIX + field_name.upper()
    return (
        f"{field_name} is {'a list' if many else 'a section'}: give it as JSON "
        f"({variable}='{'[{...}]' if many else '{...}'}') or set its parts ({variable}__{'0__' if many else ''}<key>)"
    )


def _is_single_value(field_name: str) -> bool:
    """Whether a top-level setting is a number, text or flag (no keys or items below it)."""
    annotation = KVPlugConfig.model_fields[field_name].annotation
    members = get_args(annotation) if get_origin(annotation) in (Union, UnionType) else (annotation,)
    # (a bounded int is Annotated; ByteSize an int: max_chunk_bytes, copy_threads took parts)
    members = tuple(get_args(m)[0] if get_origin(m) is Annotated else m for m in members)
    return all(
        member is type(None)
        or get_origin(member) is Literal
        or (isinstance(member, type) and issubclass(member, (int, float, str)))
        for member in members
    )


def _env_value(text: str, setting: str) -> Any:
    if not text.lstrip().startswith(("[", "{")):
        return text
    try:
        value = json.loads(text, object_pairs_hook=_no_repeated_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{setting}: a value starting with [ or {{ is JSON, and this is not valid JSON: {exc}"
        ) from None
    except RecursionError:  # (json's decoder recurses per level)
        raise ValueError(f"{setting}: the JSON is nested more than {MAX_NESTING} levels deep") from None
    if _depth(value) > MAX_NESTING:
        raise ValueError(f"{setting}: the JSON is nested more than {MAX_NESTING} levels deep")
    return value


def _depth(value: Any) -> int:
    """How many lists and mappings deep ``value`` is (0: a number or text)."""
    depth, level = 0, [value]
    while containers := [item for item in level if isinstance(item, (dict, list))]:
        depth += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return depth


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a key given twice (``json`` keeps the last silently,
    as PyYAML does: see :class:`_NoAliasLoader`)."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"key {key!r} is given twice in one JSON object")
        result[key] = value
    return result


def _key_path(parts: list[str]) -> list[str | int]:
    """A setting's path from a name's parts: ASCII digits pick a list item (``0`` and ``00`` alike)."""
    return [int(part) if part.isascii() and part.isdigit() else part for part in parts]


def _given_twice(seen: dict[tuple[str | int, ...], str], path: list[str | int], name: str) -> str | None:
    """The error if another name of one layer (in ``seen``) set ``path`` (``KVPLUG_CHUNK_SIZE`` and
    ``kvplug_chunk_size``, ``tiers.0`` and ``tiers.00``): one of them would win unnoticed."""
    other = seen.setdefault(tuple(path), name)
    return None if other == name else f"sets the same setting as {other}: give it once"


def _dots(key: str) -> tuple[int, str]:
    return key.count("."), key


def _set_path(target: Any, path: list[str | int], value: Any) -> None:
    """Set ``value`` at ``path`` under ``target``, making mappings on the way; an int part picks a
    list item, or keys a mapping merged into a lower layer's list (:func:`_merge`)."""
    *parents, leaf = path
    for depth, part in enumerate(parents):
        child = _child(target, part, path[: depth + 1])
        if child is None:
            child = {}
            target[part] = child
        target = child
    if isinstance(target, list):
        _child(target, leaf, path)
    elif not isinstance(target, dict):
        raise ValueError(f"{_dotted(path[:-1])} is a single value: it has no part {leaf!r}")
    target[leaf] = value


def _child(target: Any, part: str | int, path: list[str | int]) -> Any:
    if isinstance(target, list):
        if not isinstance(part, int) or part >= len(target):
            raise ValueError(f"{_dotted(path[:-1])} is {items_phrase(len(target))}: it has no item {part!r}")
        return target[part]
    if not isinstance(target, dict):
        raise ValueError(f"{_dotted(path[:-1])} is a single value: it has no part {part!r}")
    return target.get(part)


def _dotted(path: list[str | int]) -> str:
    return ".".join(str(part) for part in path)


def engine_config_layer(extra: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """kvplug's part of an engine's extra config, and the config file it names.

    Accepts ``{"kvplug": {...}}`` and ``{"kvplug.chunk_size": 128,
    "kvplug.store.queue.mode": "sync", "kvplug.config": "kvplug.yaml"}``; other keys
    belong to other connectors and are ignored.
    """
    layer: dict[str, Any] = {}
    nested = extra.get("kvplug")
    if nested is not None:
        if not isinstance(nested, Mapping):
            raise ConfigError([ConfigProblem("kvplug", nested, "must be a mapping")], "engine extra config")
        layer = deep_copy(nested)
    problems: list[ConfigProblem] = []
    seen: dict[tuple[str | int, ...], str] = {}
    # Keys of other connectors may be anything; ours are text. Whole values before their parts
    # (as in the environment): in the engine's order, "kvplug.store" after "kvplug.store.queue.mode"
    # replaced the section and lost the mode.
    ours = sorted((key for key in extra if isinstance(key, str) and key.startswith(ENGINE_KEY_PREFIX)), key=_dots)
    for key in ours:
        path = _key_path(key[len(ENGINE_KEY_PREFIX) :].split("."))
        problem = _given_twice(seen, path, key)
        if problem is None:
            try:
                _set_path(layer, path, extra[key])
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            problems.append(ConfigProblem(key, extra[key], problem))
    if problems:
        raise ConfigError(problems, "engine extra config")
    config_file = layer.pop("config", None)
    if config_file is not None and not isinstance(config_file, (str, os.PathLike)):
        kind = "a mapping" if isinstance(config_file, Mapping) else f"a {type(config_file).__name__}"
        raise ConfigError(
            [
                ConfigProblem(
                    "kvplug.config",
                    config_file,
                    f"must be the path of a YAML file, not {kind}; give settings as a nested 'kvplug' mapping "
                    "or as kvplug.<setting> keys",
                )
            ],
            "engine extra config",
        )
    return layer, None if config_file is None else os.fspath(config_file)


def items_phrase(count: int) -> str:
    """``a list of 2 items``: how errors name a list's length."""
    return f"a list of {count} item{'' if count == 1 else 's'}"


def deep_copy(value: Any) -> Any:
    """A copy of nested mappings and lists, so that merging a layer never changes the layer."""
    if isinstance(value, Mapping):
        return {k: deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [deep_copy(v) for v in value]
    return value
