"""Config layers given what no one writes on purpose: every one is a :class:`ConfigError`
naming the file (and its line) or the variable, never a traceback, a hang or a silent choice."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplug import load_config
from kvplug.core.config.yaml_layer import MAX_CONFIG_FILE_BYTES, MAX_NESTING
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError


@pytest.fixture
def registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu,disk")


def refused(registry: PluginRegistry, **kwargs: object) -> str:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(registry=registry, **kwargs)  # type: ignore[arg-type]
    return str(info.value)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        # PyYAML builds a list key before it checks keys are hashable: a TypeError escaped.
        ("chunk_size: 64\n? [a, b]\n: 1\n", "a key must be text, not a list"),
        ("? {a: 1}\n: 1\n", "a key must be text, not a mapping"),
        ("? !!set {a}\n: 1\n", "a key must be text, not a set"),
        # A merge key without an alias: "could not determine a constructor for the tag".
        ("<<: {chunk_size: 128}\n", "merge keys (<<) are not allowed in a kvplug config"),
    ],
)
def test_keys_that_are_no_text_are_refused_at_their_line(
    registry: PluginRegistry, tmp_path: Path, text: str, words: str
) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text(text)
    message = refused(registry, config_file=path)
    assert f"in {path}" in message
    assert words in message
    assert "line " in message


def test_a_file_nested_past_the_bound_is_refused_not_a_recursion_error(
    registry: PluginRegistry, tmp_path: Path
) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text("tiers: " + "[" * 5000 + "]" * 5000 + "\n")
    message = refused(registry, config_file=path)
    assert f"nested more than {MAX_NESTING} levels deep" in message
    assert "line 1" in message


@pytest.mark.parametrize("depth", [MAX_NESTING + 1, 5000])
def test_an_env_json_value_nested_past_the_bound_names_the_variable(registry: PluginRegistry, depth: int) -> None:
    message = refused(registry, env={"KVPLUG_TIERS": "[" * depth + "]" * depth})
    assert "env KVPLUG_TIERS" in message
    assert f"nested more than {MAX_NESTING} levels deep" in message


def test_a_file_past_the_size_bound_is_refused_before_it_is_parsed(registry: PluginRegistry, tmp_path: Path) -> None:
    path = tmp_path / "weights.safetensors"
    # Valid YAML (one comment line): only its size is wrong.
    path.write_text("#" * MAX_CONFIG_FILE_BYTES + "\nchunk_size: 64\n")
    message = refused(registry, config_file=path)
    assert f"in {path}" in message
    assert "over 1048576 bytes" in message
    # At the bound it is read.
    path.write_text("chunk_size: 64\n#" + "#" * (MAX_CONFIG_FILE_BYTES - 17) + "\n")
    assert path.stat().st_size == MAX_CONFIG_FILE_BYTES
    assert load_config(registry=registry, config_file=path, env={}).config.chunk_size == 64


@pytest.mark.parametrize(
    ("env", "words"),
    [
        # Names are read in any case: the one sorted last won, unnoticed.
        (
            {"KVPLUG_CHUNK_SIZE": "64", "kvplug_chunk_size": "128"},
            "env kvplug_chunk_size: sets the same setting as KVPLUG_CHUNK_SIZE: give it once",
        ),
        # 0 and 00 are item 0 alike.
        (
            {
                "KVPLUG_TIERS": '[{"type": "cpu"}]',
                "KVPLUG_TIERS__0__MAX_BYTES": "1GiB",
                "KVPLUG_TIERS__00__MAX_BYTES": "2GiB",
            },
            "env KVPLUG_TIERS__0__MAX_BYTES: sets the same setting as KVPLUG_TIERS__00__MAX_BYTES: give it once",
        ),
    ],
)
def test_two_variables_for_one_setting_are_refused_naming_both(
    registry: PluginRegistry, env: dict[str, str], words: str
) -> None:
    assert words in refused(registry, env=env)


def test_two_engine_keys_for_one_setting_are_refused_naming_both(registry: PluginRegistry) -> None:
    extra = {"kvplug.tiers": [{"type": "cpu"}], "kvplug.tiers.0.max_bytes": "1GiB", "kvplug.tiers.00.max_bytes": "2GiB"}
    message = refused(registry, engine_extra=extra)
    assert "kvplug.tiers.00.max_bytes: sets the same setting as kvplug.tiers.0.max_bytes: give it once" in message


def test_an_engine_section_given_whole_after_one_of_its_parts_keeps_the_part(registry: PluginRegistry) -> None:
    # The engine's order of keys: the section came after the part and replaced it, mode and all.
    extra = {"kvplug.store.queue.mode": "sync", "kvplug.store": {"queue": {"max_items": 8}}}
    loaded = load_config(registry=registry, engine_extra=extra, env={})
    assert (loaded.config.store.queue.mode, loaded.config.store.queue.max_items) == ("sync", 8)
    assert loaded.sources["store.queue.mode"] == "engine"


def test_engine_keys_that_are_not_text_belong_to_others(registry: PluginRegistry) -> None:
    # `key.startswith` on an int key: AttributeError out of the engine adapter.
    loaded = load_config(registry=registry, engine_extra={1: "theirs", "kvplug.chunk_size": 64}, env={})
    assert loaded.config.chunk_size == 64


BAD_FILE = "chunk_size: 64\ntiers:\n  - type: cpu\n  - type: cpu\n    max_bytes: -3\n    nope: 1\nstore:\n  queue:\n    mode: bogus\n"


def test_a_file_that_set_everything_is_named_with_each_problems_line(registry: PluginRegistry, tmp_path: Path) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text(BAD_FILE)
    message = refused(registry, config_file=path)
    # It said "invalid kvplug config:" and each problem with no word of the file or its line.
    assert f"invalid kvplug config in {path}:" in message
    assert "tiers[1].max_bytes: Value error, must not be negative; line 5 (got -3)" in message
    assert "tiers[1].nope: unknown key;" in message and "; line 6 (got 1)" in message
    assert "store.queue.mode: Input should be 'sync' or 'async'; line 9 (got 'bogus')" in message


def test_a_problem_set_in_the_file_under_other_layers_names_the_files_line(
    registry: PluginRegistry, tmp_path: Path
) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text(BAD_FILE)
    message = refused(registry, config_file=path, env={"KVPLUG_CHUNK_SIZE": "0"})
    assert "chunk_size: Input should be greater than 0; set in env KVPLUG_CHUNK_SIZE (got '0')" in message
    assert f"must not be negative; set in file {path}, line 5 (got -3)" in message
    assert f"set in file {path}, line 9 (got 'bogus')" in message


@pytest.mark.parametrize(
    ("env", "extra"),
    [({"KVPLUG_SERIALIZER__THREADS": "2"}, {}), ({}, {"kvplug.serializer.threads": 2})],
)
def test_a_later_layers_options_alone_apply_to_the_component_an_earlier_layer_chose(
    tmp_path: Path, env: dict[str, str], extra: dict[str, object]
) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text("serializer: {type: zstd, segment_bytes: 65536}\n")
    registry = PluginRegistry(plugin_filter="cpu,compress")
    # The options replaced the file's spec whole: "serializer.type: Field required".
    loaded = load_config(registry=registry, config_file=path, env=env, engine_extra=extra)
    assert loaded.config.serializer.type == "zstd"
    options = loaded.config.serializer.raw_options
    assert {key: int(value) for key, value in options.items()} == {"segment_bytes": 65536, "threads": 2}
    assert loaded.sources["serializer"] == f"file {path}"
    assert loaded.sources["serializer.threads"] == ("env" if env else "engine")
    # A type given replaces the spec whole: the file's options were for the file's type.
    loaded = load_config(registry=registry, config_file=path, env={"KVPLUG_SERIALIZER": '{"type": "lz4"}'})
    assert (loaded.config.serializer.type, loaded.config.serializer.raw_options) == ("lz4", {})


@pytest.mark.parametrize("text", ["chunk_size: 64\n1: a\n", "chunk_size: 64\n~: a\n", "chunk_size: 64\ntrue: a\n"])
def test_a_key_that_is_no_text_is_named_with_its_line(registry: PluginRegistry, tmp_path: Path, text: str) -> None:
    # 1, ~ and true are YAML's int, null and bool: "Keys should be strings", at no line.
    path = tmp_path / "kvplug.yaml"
    path.write_text(text)
    message = refused(registry, config_file=path)
    assert "Keys should be strings; line 2" in message


def test_keys_that_are_equal_once_read_are_a_key_given_twice(registry: PluginRegistry, tmp_path: Path) -> None:
    # 1 and true are one key of a dict: the first went unnoticed, and the lines of the keys after it were off.
    path = tmp_path / "kvplug.yaml"
    path.write_text("1: a\ntrue: b\nchunk_size: 0\n")
    message = refused(registry, config_file=path)
    assert "key True is given twice" in message and "line 2" in message


@pytest.mark.parametrize(
    "name", ["KVPLUG_MAX_CHUNK_BYTES__LIMIT", "KVPLUG_COPY_THREADS__0", "KVPLUG_HEADS_PER_RECORD__AUTO"]
)
def test_a_part_of_a_bounded_number_is_refused_naming_the_variable(registry: PluginRegistry, name: str) -> None:
    # A bounded int (Annotated) or a ByteSize was taken for a section: the part went on to
    # validation as {'limit': '8'}, named by no variable.
    message = refused(registry, env={name: "8"})
    assert f"env {name}: " in message and "is a single value: it has no part" in message


@pytest.mark.parametrize(
    ("name", "words"),
    [
        ("KVPLUG_TIERS", "tiers is a list: give it as JSON (KVPLUG_TIERS='[{...}]')"),
        ("KVPLUG_SERIALIZER", "serializer is a section: give it as JSON (KVPLUG_SERIALIZER='{...}')"),
    ],
)
def test_plain_text_for_a_list_or_section_names_the_variable_and_json(
    registry: PluginRegistry, name: str, words: str
) -> None:
    # It was pydantic's "tiers: Input should be a valid list (got 'cpu')", naming no variable.
    message = refused(registry, env={name: "cpu"})
    assert f"env {name}: {words}" in message


def test_a_value_replaced_whole_is_credited_to_the_layer_that_replaced_it(
    registry: PluginRegistry, tmp_path: Path
) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text("tiers: [{type: cpu}]\n")
    env = {"KVPLUG_TIERS__0__MAX_BYTES": "1GiB"}
    engine = {"kvplug.tiers": [{"type": "cpu", "max_bytes": "2GiB"}]}
    loaded = load_config(registry=registry, config_file=path, env=env, engine_extra=engine)
    assert loaded.config.tiers[0].options.max_bytes == 2 << 30
    # The engine's list replaced the environment's part with the file's list: `config show` said
    # "tiers: engine; tiers.0.max_bytes: env", and an error blamed the variable.
    assert {key: source for key, source in loaded.sources.items() if key.startswith("tiers")} == {"tiers": "engine"}
    engine = {"kvplug.tiers": [{"type": "cpu", "max_bytes": 0}]}
    message = refused(registry, config_file=path, env=env, engine_extra=engine)
    assert "must be greater than 0" in message and "KVPLUG_TIERS__0__MAX_BYTES" not in message


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"kvplug_chunk_size": "-1"}, "set in env kvplug_chunk_size (got"),
        ({"KVPLUG_TIERS__00__MAX_BYTES": "0"}, "set in env KVPLUG_TIERS__00__MAX_BYTES (got"),
        ({"KVPLUG_STORE": '{"queue": {"mode": "bogus"}}'}, "set in env KVPLUG_STORE (got"),
    ],
)
def test_an_error_names_the_variable_as_it_was_set(
    registry: PluginRegistry, tmp_path: Path, env: dict[str, str], named: str
) -> None:
    # It named the variable a path spells (KVPLUG_CHUNK_SIZE, KVPLUG_TIERS__0__MAX_BYTES,
    # KVPLUG_STORE__QUEUE__MODE): not one the user set, so grepping the environment found nothing.
    path = tmp_path / "kvplug.yaml"
    path.write_text("tiers: [{type: cpu}]\n")
    assert named in refused(registry, config_file=path, env=env)
