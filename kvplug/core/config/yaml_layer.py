"""The YAML file layer of a kvplug config: read with every construct a config has no use for
refused (aliases, merge keys, a key given twice, keys that are not text, deep nesting, a file
too large to be a config), each named by its line (:mod:`kvplug.core.config.layers`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from kvplug.errors import ConfigError, ConfigProblem

#: The largest config file read. A config is a few kilobytes; a path that names a model's
#: weights or a device (``/dev/zero``) by mistake is refused, not read whole into memory.
MAX_CONFIG_FILE_BYTES = 1 << 20
#: The deepest nesting of mappings and lists a config file or a ``KVPLUG_*`` JSON value may
#: have (a kvplug config has about five levels): deeper, PyYAML's and json's recursive readers
#: would end in a ``RecursionError`` rather than an error naming the file or variable.
MAX_NESTING = 64


class _NoAliasLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` without aliases: a few hundred bytes of nested aliases (a "billion
    laughs" file) expand to millions of nodes when the config is merged and validated. A
    kvplug config has no use for them; an alias is a YAML error that names it. A key given
    twice in one mapping is an error too: PyYAML keeps the last silently, so a file that
    lists alternatives (``serializer: {type: zstd}`` then ``serializer: {type: int8}``)
    would run the one below unnoticed. Merge keys (``<<``) only make sense with aliases, and
    nesting past :data:`MAX_NESTING` is refused at its line."""

    _depth = 0

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping",
                    node.start_mark,
                    "merge keys (<<) are not allowed in a kvplug config",
                    key_node.start_mark,
                )
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (list, dict, set)):  # (``? [a, b]``: PyYAML's own check comes after ours)
                kind = {"dict": "mapping"}.get(type(key).__name__, type(key).__name__)
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"a key must be text, not a {kind}", key_node.start_mark
                )
            if key in seen:  # (1, 1.0 and true too: one key of a dict)
                raise yaml.constructor.ConstructorError(
                    "while reading a mapping", node.start_mark, f"key {key!r} is given twice", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.events.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None, None, f"aliases (*{event.anchor}) are not allowed in a kvplug config", event.start_mark
            )
        if self._depth >= MAX_NESTING:
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_NESTING} levels deep", event.start_mark
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def read_yaml_layer(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The settings of a YAML config file (see :func:`read_yaml_layer_lines`)."""
    return read_yaml_layer_lines(path)[0]


def read_yaml_layer_lines(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, int]]:
    """The settings of a YAML config file, and the line of each key and list item in it, by
    dotted path (``store.queue.mode``, ``tiers.0.max_bytes``), for errors to name."""
    source = str(path)
    try:
        with Path(path).open("rb") as file:
            raw = file.read(MAX_CONFIG_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError([ConfigProblem("", source, f"cannot read config file: {exc.strerror}")], source) from None
    except ValueError as exc:  # a NUL in the path
        raise ConfigError([ConfigProblem("", source, f"cannot read config file: {exc}")], source) from None
    if len(raw) > MAX_CONFIG_FILE_BYTES:
        message = (
            f"the file is over {MAX_CONFIG_FILE_BYTES} bytes (1 MiB), and a kvplug config is a few kilobytes: "
            "is this the config file?"
        )
        raise ConfigError([ConfigProblem("", source, message)], source)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        message = f"not valid UTF-8: byte {exc.start} (line {line}) is {raw[exc.start : exc.start + 1]!r}; save the file as UTF-8"
        raise ConfigError([ConfigProblem("", source, message)], source) from None
    loader = _NoAliasLoader(text)  # a SafeLoader that also refuses aliases
    loader.name = source  # its marks name the file, not "<unicode string>" (a str is read, for the checks above)
    try:
        node = loader.get_single_node()
        data = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as exc:
        raise ConfigError([ConfigProblem("", source, f"not valid YAML: {exc}")], source) from None
    finally:
        loader.dispose()
    if node is None or data is None:
        return {}, {}
    if not isinstance(data, dict):
        raise ConfigError([ConfigProblem("", data, "the top level must be a mapping")], source)
    lines: dict[str, int] = {}
    _note_lines(node, data, "", lines)
    return data, lines


def _note_lines(node: yaml.Node, data: Any, prefix: str, lines: dict[str, int]) -> None:
    """Note in ``lines`` the line of each key and item under ``node`` (``data``, as read), by the
    path an error gives it: each key as read (``None``, ``1``; ``true`` as pydantic names it, ``1``)."""
    children: list[tuple[str, yaml.Node, yaml.Node, Any]] = []  # (path, where it is written, value node, value)
    if isinstance(node, yaml.MappingNode) and isinstance(data, dict):
        # (the mapping's keys in the file's order: a key given twice was refused)
        keys = [int(key) if isinstance(key, bool) else key for key in data]
        children = [(f"{prefix}{key}", k, v, data[raw]) for (k, v), key, raw in zip(node.value, keys, data)]
    elif isinstance(node, yaml.SequenceNode) and isinstance(data, list):
        children = [(f"{prefix}{index}", item, item, data[index]) for index, item in enumerate(node.value)]
    for path, written, value_node, value in children:
        lines[path] = written.start_mark.line + 1
        _note_lines(value_node, value, path + ".", lines)
