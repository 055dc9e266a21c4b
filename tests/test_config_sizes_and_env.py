"""One rule for byte sizes, and every ``KVPLUG_*`` variable applies or is an error naming it.

Byte sizes were pydantic's ``ByteSize`` wherever a field was typed so: ``"99999999EiB"`` passed
(then failed as "more than physical memory", or not at all for disk budgets) while the integer
2**64 was refused, and ``-1GiB`` "could not parse". Environment variables went through
pydantic-settings, which ignored ``KVPLUG_TIERS__0__MAX_BYTES`` beside ``KVPLUG_TIERS`` and
dropped ``KVPLUG_TIERS__0__NO_SUCH_KEY`` without a word.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplug import load_config
from kvplug.core.config_types import MAX_BYTE_SIZE, parse_byte_size
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError

UNITS = {"": 1, "B": 1, "KB": 10**3, "KiB": 2**10, "MB": 10**6, "MiB": 2**20, "GB": 10**9, "GiB": 2**30}
UNITS |= {"TB": 10**12, "TiB": 2**40, "PB": 10**15, "PiB": 2**50, "EB": 10**18, "EiB": 2**60}


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu,disk")


def error_text(registry: PluginRegistry, **kwargs: Any) -> str:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(registry=registry, **kwargs)
    return str(info.value)


# -- byte sizes ---------------------------------------------------------------------------------


@given(st.integers(min_value=0, max_value=MAX_BYTE_SIZE // 2**60), st.sampled_from(sorted(UNITS)))
def test_a_size_with_any_unit_is_its_bytes_or_refused_over_4_eib(number: int, unit: str) -> None:
    text = f"{number}{unit}"
    expected = number * UNITS[unit]
    if expected <= MAX_BYTE_SIZE:
        assert parse_byte_size(text) == expected
        assert parse_byte_size(expected) == expected
    else:
        with pytest.raises(ValueError, match="at most 4 EiB"):
            parse_byte_size(text)


@given(st.one_of(st.text(max_size=30), st.integers(), st.floats(), st.booleans(), st.none(), st.lists(st.integers())))
def test_any_value_is_a_size_in_range_or_a_value_error(value: object) -> None:
    try:
        size = parse_byte_size(value)
    except ValueError as exc:
        assert str(exc)
    else:
        assert isinstance(size, int) and not isinstance(size, bool)
        assert 0 <= size <= MAX_BYTE_SIZE


@pytest.mark.parametrize(
    ("where", "settings"),
    [
        ("tiers[0].max_bytes", lambda size: {"tiers": [{"type": "cpu", "max_bytes": size}]}),
        ("tiers[0].max_bytes", lambda size: {"tiers": [{"type": "disk", "path": "/tmp/kvplug-x", "max_bytes": size}]}),
        ("store.queue.max_bytes", lambda size: {"store": {"queue": {"max_bytes": size}}}),
        ("store.frame_pool_bytes", lambda size: {"store": {"frame_pool_bytes": size}}),
        ("tiers[0].queue.max_bytes", lambda size: {"tiers": [{"type": "cpu", "queue": {"max_bytes": size}}]}),
    ],
)
@pytest.mark.parametrize(
    ("size", "words"),
    [
        ("99999999EiB", "at most 4 EiB"),
        (2**64, "at most 4 EiB"),
        ("-1GiB", "must not be negative"),
        (-1, "must not be negative"),
        ("lots", "'lots' is not a byte size"),
        ("8GiB of memory", "'8GiB of memory' is not a byte size"),
        (1.5, "not a float"),
        (True, "not a boolean"),
    ],
)
def test_every_size_setting_refuses_the_same_values_with_the_same_words(
    registry: PluginRegistry, where: str, settings: Any, size: object, words: str
) -> None:
    text = error_text(registry, engine_extra={"kvplug": settings(size)})
    assert where in text and words in text, text


def test_pin_and_quota_shares_follow_the_size_rule(registry: PluginRegistry) -> None:
    tier = {"type": "cpu", "max_bytes": "1GiB"}
    text = error_text(registry, engine_extra={"kvplug": {"tiers": [tier | {"pin_max_bytes": "-5MiB"}]}})
    assert "pin_max_bytes" in text and "must not be negative" in text, text
    text = error_text(registry, engine_extra={"kvplug": {"tiers": [tier | {"quotas": {"default": "99999999EiB"}}]}})
    assert "at most 4 EiB" in text, text


def test_sizes_in_range_are_accepted_as_text_or_integers(registry: PluginRegistry) -> None:
    for size in ("1.5GiB", " 512 MiB ", 3 * 2**30, "1073741824"):
        loaded = load_config(
            registry=registry, env={}, engine_extra={"kvplug": {"store": {"queue": {"max_bytes": size}}}}
        )
        assert loaded.config.store.queue.max_bytes == parse_byte_size(size)


# -- environment variables ----------------------------------------------------------------------


@pytest.fixture
def one_cpu_tier_file(tmp_path: Path) -> Path:
    path = tmp_path / "kvplug.yaml"
    path.write_text("tiers:\n  - type: cpu\n    max_bytes: 1GiB\n")
    return path


def tier_options(loaded: Any, index: int = 0) -> dict[str, Any]:
    return dict(loaded.config.tiers[index].model_extra or {})


def test_an_item_variable_beside_the_whole_list_applies(registry: PluginRegistry) -> None:
    env = {"KVPLUG_TIERS": '[{"type": "cpu", "max_bytes": "1GiB"}]', "KVPLUG_TIERS__0__MAX_BYTES": "2GiB"}
    assert tier_options(load_config(registry=registry, env=env))["max_bytes"] == "2GiB"


def test_an_item_variable_changes_the_config_files_list(registry: PluginRegistry, one_cpu_tier_file: Path) -> None:
    env = {"KVPLUG_TIERS__0__MAX_BYTES": "3GiB", "KVPLUG_TIERS__0__PIN_MAX_BYTES": "10%"}
    loaded = load_config(registry=registry, env=env, config_file=one_cpu_tier_file)
    assert tier_options(loaded) == {"max_bytes": "3GiB", "pin_max_bytes": "10%"}
    assert loaded.config.tiers[0].type == "cpu"


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ({"KVPLUG_TIERS__0__NO_SUCH_KEY": "x"}, "tiers[0].no_such_key: unknown key"),
        (
            {"KVPLUG_TIERS__3__MAX_BYTES": "1GiB"},
            "env KVPLUG_TIERS__3__MAX_BYTES: sets item 3 of tiers, which is a list of 1 item",
        ),
        ({"KVPLUG_CHUNK_SIZE__X": "3"}, "env KVPLUG_CHUNK_SIZE__X: chunk_size is a single value"),
        ({"KVPLUG_TIERS__0__MAX_BYTES__X": "3"}, "tiers[0].max_bytes: Value error, must be a byte size"),
        ({"KVPLUG_STORE____QUEUE": "3"}, "env KVPLUG_STORE____QUEUE: an empty key"),
        ({"KVPLUG_NO_SUCH_SETTING": "3"}, "env KVPLUG_NO_SUCH_SETTING: unknown setting"),
        ({"KVPLUG_TIERS": "[{oops"}, "env KVPLUG_TIERS: tiers: a value starting with [ or { is JSON"),
    ],
)
def test_a_variable_that_cannot_apply_is_an_error_naming_it(
    registry: PluginRegistry, one_cpu_tier_file: Path, env: dict[str, str], words: str
) -> None:
    assert words in error_text(registry, env=env, config_file=one_cpu_tier_file)


def test_an_item_variable_without_a_list_to_change_says_so(registry: PluginRegistry) -> None:
    text = error_text(registry, env={"KVPLUG_TIERS__0__MAX_BYTES": "1GiB"})
    assert "env KVPLUG_TIERS__0__MAX_BYTES: sets item 0 of tiers" in text and "give the whole list" in text


def test_engine_keys_pick_list_items_by_number_too(registry: PluginRegistry, one_cpu_tier_file: Path) -> None:
    loaded = load_config(
        registry=registry, env={}, config_file=one_cpu_tier_file, engine_extra={"kvplug.tiers.0.max_bytes": "5GiB"}
    )
    assert tier_options(loaded)["max_bytes"] == "5GiB"


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (
            {"env": {"KVPLUG_CHUNK_SIZE": "abc"}},
            "chunk_size: Value error, must be a whole number, e.g. 256, not other text; set in env KVPLUG_CHUNK_SIZE (got 'abc')",
        ),
        ({"env": {"KVPLUG_TIERS__0__MAX_BYTES": "-5"}}, "must not be negative; set in env KVPLUG_TIERS__0__MAX_BYTES"),
        (
            {"env": {"KVPLUG_TIERS": '[{"type": "cpu", "max_bytes": 0}]'}},
            "stores nothing); set in env KVPLUG_TIERS (got 0)",
        ),
        ({"engine_extra": {"kvplug.tiers.0.max_bytes": "0"}}, "set in the engine's config, kvplug.tiers.0.max_bytes"),
        (
            {"engine_extra": {"kvplug": {"store": {"queue": {"mode": "x"}}}}},
            "set in the engine's config, kvplug.store.queue.mode",
        ),
        ({"engine_extra": {"kvplug.chunk_size": "1.5"}}, "set in the engine's config, kvplug.chunk_size"),
    ],
)
def test_a_bad_value_names_the_layer_that_set_it_over_a_good_file(
    registry: PluginRegistry, one_cpu_tier_file: Path, kwargs: dict[str, Any], words: str
) -> None:
    one_cpu_tier_file.write_text(one_cpu_tier_file.read_text() + "chunk_size: 256\n")
    assert words in error_text(registry, config_file=one_cpu_tier_file, **kwargs)


def test_a_bad_value_names_no_layer_when_one_layer_set_everything(
    registry: PluginRegistry, one_cpu_tier_file: Path
) -> None:
    one_cpu_tier_file.write_text("chunk_size: -1\n")
    assert "set in" not in error_text(registry, config_file=one_cpu_tier_file)


def test_a_bad_value_in_the_file_names_the_file(registry: PluginRegistry, one_cpu_tier_file: Path) -> None:
    one_cpu_tier_file.write_text("tiers: [{type: cpu, max_bytes: 0}]\nchunk_size: [1]\n")
    text = error_text(registry, config_file=one_cpu_tier_file, env={"KVPLUG_HASH": "sha256"})
    assert f"stores nothing); set in file {one_cpu_tier_file}, line 1 (got 0)" in text
    assert f"set in file {one_cpu_tier_file}, line 2 (got [1])" in text


SEGMENTS = ["chunk_size", "store", "queue", "mode", "max_bytes", "tiers", "0", "1", "nope", "type", ""]
VALUES = ["sync", "128", "1GiB", "x", "[]", "{}", "-1", "[{", "cpu"]


def _dig(value: Any, part: str) -> Any:
    if isinstance(value, (list, tuple)):
        return value[int(part)]
    extra = getattr(value, "model_extra", None) or {}
    return extra[part] if part in extra else getattr(value, part)


@settings(max_examples=300, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=4), st.sampled_from(VALUES))
def test_any_variable_either_applies_or_is_an_error_naming_it(
    registry: PluginRegistry, one_cpu_tier_file: Path, segments: list[str], value: str
) -> None:
    name = "KVPLUG_" + "__".join(segments).upper()
    try:
        loaded = load_config(registry=registry, env={name: value}, config_file=one_cpu_tier_file)
    except ConfigError as exc:
        text = str(exc)
        # Named by its variable, or by its setting's path as the model reports it (store.queue.mode).
        dotted = [".".join(segments[:n]) for n in range(1, len(segments) + 1)]
        bracketed = [d.replace(".0", "[0]").replace(".1", "[1]") for d in dotted]
        assert name in text or any(p and p in text for p in dotted + bracketed), (name, value, text)
        return
    got: Any = loaded.config
    for part in segments:
        got = _dig(got, part)
    if not value.startswith(("[", "{")):
        assert str(got) == value or got == int(value), (name, value, got)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"env": {"KVPLUG_CHUNK_SIZ": "3"}}, "did you mean 'KVPLUG_CHUNK_SIZE'?"),
        ({"engine_extra": {"kvplug": {"tiers": [{"type": "cpu", "max_byte": "1GiB"}]}}}, "did you mean 'max_bytes'?"),
        ({"engine_extra": {"kvplug": {"store": {"queue": {"mod": "sync"}}}}}, "did you mean 'mode'?"),
    ],
)
def test_a_misspelled_key_gets_a_suggestion(registry: PluginRegistry, kwargs: dict[str, Any], words: str) -> None:
    assert words in error_text(registry, **kwargs)


def test_no_suggestion_for_a_key_like_none(registry: PluginRegistry) -> None:
    assert "did you mean" not in error_text(registry, engine_extra={"kvplug": {"zzzz": 1}})


# -- YAML aliases -------------------------------------------------------------------------------

_SCALARS = st.one_of(st.integers(-5, 5), st.sampled_from(["x", "1GiB", "cpu", "sync", "true", "null"]))


@st.composite
def yaml_with_an_alias(draw: st.DrawFn) -> tuple[str, str]:
    """A YAML document with an anchored node and, somewhere after it, an alias of it."""
    anchor = draw(st.from_regex(r"[a-z][a-z0-9]{0,6}", fullmatch=True))
    value = draw(
        st.one_of(_SCALARS.map(str), st.lists(_SCALARS.map(str), max_size=4).map(lambda v: f"[{', '.join(v)}]"))
    )
    key = draw(st.sampled_from(["chunk_size", "tiers", "store", "x", "hash"]))
    where = draw(st.sampled_from(["top", "list", "map", "merge"]))
    if where == "top":
        text = f"a: &{anchor} {value}\n{key}: *{anchor}\n"
    elif where == "list":
        text = f"a: &{anchor} {value}\n{key}: [1, *{anchor}]\n"
    elif where == "map":
        text = f"a: &{anchor} {value}\n{key}: {{inner: *{anchor}}}\n"
    else:
        text = f"base: &{anchor} {{type: cpu}}\ntiers:\n  - <<: *{anchor}\n    max_bytes: 1GiB\n"
    return text, anchor


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(yaml_with_an_alias())
def test_any_alias_in_a_config_file_is_refused_naming_it(
    registry: PluginRegistry, tmp_path: Path, document: tuple[str, str]
) -> None:
    text, anchor = document
    path = tmp_path / "aliased.yaml"
    path.write_text(text)
    assert f"aliases (*{anchor}) are not allowed" in error_text(registry, config_file=path), text
