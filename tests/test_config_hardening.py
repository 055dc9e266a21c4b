"""Values that ``config validate`` must refuse: accepted, they would fail later or do nothing.

Each bad value must be a :class:`ConfigError` naming the field; the CLI must print it without a traceback.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplug import load_config
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError


@pytest.fixture
def full_registry() -> PluginRegistry:
    """Builtins plus the cpu and disk tiers (disk gives tiers with a location)."""
    return PluginRegistry(plugin_filter="cpu,disk")


def problem_paths(registry: PluginRegistry, **kwargs: object) -> tuple[list[str], str]:
    kwargs.setdefault("env", {})
    with pytest.raises(ConfigError) as info:
        load_config(registry=registry, **kwargs)  # type: ignore[arg-type]
    return [p.path for p in info.value.problems], str(info.value)


@pytest.mark.parametrize(
    ("settings", "path", "words"),
    [
        ({"tiers": [{"type": "cpu", "max_bytes": 0}]}, "tiers[0].max_bytes", "greater than 0"),
        ({"chunk_size": True}, "chunk_size", "not a boolean"),
        ({"chunk_size": 1e32}, "chunk_size", "not a float"),
        ({"chunk_size": 10**32}, "chunk_size", "less than or equal"),
        ({"chunk_size": 8.0}, "chunk_size", "not a float"),
        ({"store": {"queue": {"max_items": False}}}, "store.queue.max_items", "not a boolean"),
        ({"tiers": [{"type": "cpu", "max_bytes": True}]}, "tiers[0].max_bytes", "not a boolean"),
        ({"tiers": [{"type": "disk", "path": "/tmp/a\0b"}]}, "tiers[0].path", "NUL"),
        ({"tiers": [{"type": "disk", "path": ""}]}, "tiers[0].path", "empty"),
    ],
)
def test_bad_values_name_their_field(full_registry: PluginRegistry, settings: dict, path: str, words: str) -> None:
    paths, text = problem_paths(full_registry, engine_extra={"kvplug": settings})
    assert path in paths, text
    assert words in text


def test_integers_from_the_environment_still_parse(full_registry: PluginRegistry) -> None:
    loaded = load_config(registry=full_registry, env={"KVPLUG_CHUNK_SIZE": "128"})
    assert loaded.config.chunk_size == 128
    paths, _ = problem_paths(full_registry, env={"KVPLUG_CHUNK_SIZE": "1e3"})
    assert paths == ["chunk_size"]


def test_two_tiers_on_one_location_are_refused(full_registry: PluginRegistry, tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    tiers = [{"type": "disk", "path": str(folder)}, {"type": "disk", "path": str(folder) + "/"}]
    paths, text = problem_paths(full_registry, engine_extra={"kvplug": {"tiers": tiers}})
    assert paths == ["tiers[1]"], text
    assert "tiers[0]" in text and str(folder) in text
    assert not folder.exists()
    # Different folders are fine.
    tiers[1]["path"] = str(tmp_path / "other")
    loaded = load_config(registry=full_registry, env={}, engine_extra={"kvplug": {"tiers": tiers}})
    assert len(loaded.config.tiers) == 2


def test_yaml_with_invalid_utf8_is_a_config_error(full_registry: PluginRegistry, tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(b"chunk_size: 64\nhash: \xff\xfesha\n")
    _, text = problem_paths(full_registry, config_file=path)
    assert "not valid UTF-8" in text and "byte 21 (line 2)" in text


@pytest.mark.parametrize("extra", [{"kvplug.config": {"chunk_size": 64}}, {"kvplug": {"config": {"chunk_size": 64}}}])
def test_config_given_as_a_mapping_is_a_config_error(full_registry: PluginRegistry, extra: dict) -> None:
    paths, text = problem_paths(full_registry, engine_extra=extra)
    assert paths == ["kvplug.config"], text
    assert "path of a YAML file" in text


def test_cli_validate_reports_without_traceback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from kvplug.cli.main import app

    cases = {
        "zero.yaml": b"tiers: [{type: cpu, max_bytes: 0}]\n",
        "bool.yaml": b"chunk_size: true\n",
        "float.yaml": b"chunk_size: 1.0e32\n",
        "utf8.yaml": b"chunk_size: \xc3\x28\n",
        "empty_path.yaml": b"tiers: [{type: disk, path: ''}]\n",
    }
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVPLUG_PLUGINS", raising=False)
    for name, text in cases.items():
        (tmp_path / name).write_bytes(text)
        result = CliRunner().invoke(app, ["config", "validate", str(tmp_path / name)])
        assert result.exit_code == 2, (name, result.output)
        assert isinstance(result.exception, SystemExit), (name, result.exception)  # an exit, not a crash
        assert "error:" in result.output and "Traceback" not in result.output, (name, result.output)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(cases)  # nothing created in the cwd


# --- values that cannot be right (inf, nan, absurd counts) ----------------

INF, NAN = float("inf"), float("nan")


@pytest.fixture
def remote_registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu,disk,s3,valkey,mooncake")


VALKEY = {"type": "valkey", "url": "redis://127.0.0.1:1/0"}
S3 = {"type": "s3", "url": "s3://bucket/prefix", "endpoint_url": "http://127.0.0.1:1"}
MOONCAKE = {"type": "mooncake", "master": "127.0.0.1:1", "metadata_server": "P2PHANDSHAKE"}


@pytest.mark.parametrize(
    ("settings", "path", "bound"),
    [
        ({"store": {"queue": {"block_timeout_s": INF}}}, "store.queue.block_timeout_s", "less than or equal to 3600"),
        ({"store": {"queue": {"block_timeout_s": NAN}}}, "store.queue.block_timeout_s", "less than or equal to 3600"),
        ({"store": {"queue": {"block_timeout_s": 1e9}}}, "store.queue.block_timeout_s", "less than or equal to 3600"),
        ({"store": {"queue": {"max_items": 10**9}}}, "store.queue.max_items", "less than or equal to 65536"),
        ({"copy_threads": 100000}, "copy_threads", "less than or equal to 256"),
        ({"lookup_budget_s": 1e12}, "lookup_budget_s", "less than or equal to 3600"),
        (
            {"tiers": [{"type": "cpu", "queue": {"max_items": 10**9}}]},
            "tiers[0].queue.max_items",
            "less than or equal to 65536",
        ),
        ({"tiers": [{**VALKEY, "request_timeout_s": INF}]}, "tiers[0].request_timeout_s", "less than or equal to 3600"),
        ({"tiers": [{**VALKEY, "connect_timeout_s": NAN}]}, "tiers[0].connect_timeout_s", "less than or equal to 3600"),
        ({"tiers": [{**VALKEY, "ttl_s": INF}]}, "tiers[0].ttl_s", "less than or equal to 31622400"),
        ({"tiers": [{**VALKEY, "backoff_max_s": INF}]}, "tiers[0].backoff_max_s", "less than or equal to 60"),
        ({"tiers": [{**VALKEY, "max_connections": 10**6}]}, "tiers[0].max_connections", "less than or equal to 1024"),
        ({"tiers": [{**VALKEY, "pipeline_keys": 10**6}]}, "tiers[0].pipeline_keys", "less than or equal to 4096"),
        ({"tiers": [{**VALKEY, "breaker_failures": 10**9}]}, "tiers[0].breaker_failures", "less than or equal to 1000"),
        ({"tiers": [{**VALKEY, "max_concurrency": 10**9}]}, "tiers[0].max_concurrency", "less than or equal to 1024"),
        ({"tiers": [{**S3, "read_timeout_s": INF}]}, "tiers[0].read_timeout_s", "less than or equal to 3600"),
        ({"tiers": [{**S3, "breaker_cooldown_s": INF}]}, "tiers[0].breaker_cooldown_s", "less than or equal to 3600"),
        ({"tiers": [{**MOONCAKE, "setup_timeout_s": INF}]}, "tiers[0].setup_timeout_s", "less than or equal to 3600"),
        (
            {"tiers": [{"type": "disk", "path": "/tmp/x", "write_threads": 100000}]},
            "tiers[0].write_threads",
            "less than or equal to 256",
        ),
        (
            {"tiers": [{"type": "disk", "path": "/tmp/x", "queue": {"block_timeout_s": INF}}]},
            "tiers[0].queue.block_timeout_s",
            "less than or equal to 3600",
        ),
        (
            {"tiers": [{"type": "disk", "path": "/tmp/x", "stale_temp_s": INF}]},
            "tiers[0].stale_temp_s",
            "less than or equal to 604800",
        ),
        (
            {"tiers": [{**VALKEY, "queue": {"max_bytes": 0}}]},
            "tiers[0].queue.max_bytes",
            "greater than 0",
        ),
        (
            {"tiers": [{"type": "disk", "path": "/tmp/x", "queue": {"max_items": 10**9}}]},
            "tiers[0].queue.max_items",
            "less than or equal to 65536",
        ),
    ],
)
def test_values_that_cannot_be_right_name_field_value_and_bound(
    remote_registry: PluginRegistry, settings: dict, path: str, bound: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(registry=remote_registry, env={}, engine_extra={"kvplug": settings})
    [problem] = [p for p in info.value.problems if p.path == path]
    assert bound in problem.message, str(info.value)
    assert str(problem).startswith(f"{path}: ") and str(problem).endswith(f"(got {problem.value!r})")
    assert isinstance(problem.value, (int, float)) and not 0 < problem.value <= 3600, problem  # the bad value


def test_infinity_from_yaml_and_the_environment_is_refused(remote_registry: PluginRegistry, tmp_path: Path) -> None:
    """YAML's ``.inf`` and ``KVPLUG_STORE__QUEUE__BLOCK_TIMEOUT_S=inf`` are floats pydantic takes as they are."""
    config = tmp_path / "c.yaml"
    config.write_text(
        "store: {queue: {block_timeout_s: .inf}}\ntiers: [{type: valkey, url: 'redis://127.0.0.1:1', request_timeout_s: .inf}]\n"
    )
    paths, text = problem_paths(remote_registry, config_file=config)
    assert paths == ["store.queue.block_timeout_s", "tiers[0].request_timeout_s"], text
    assert "finite" in text and "(got inf)" in text
    paths, _ = problem_paths(remote_registry, env={"KVPLUG_STORE__QUEUE__BLOCK_TIMEOUT_S": "inf"})
    assert paths == ["store.queue.block_timeout_s"]


def test_bounded_values_at_the_bounds_are_accepted(remote_registry: PluginRegistry) -> None:
    settings = {
        "copy_threads": 256,
        "lookup_budget_s": 3600,
        "store": {"queue": {"block_timeout_s": 3600, "max_items": 65536}},
        "tiers": [{**VALKEY, "request_timeout_s": 0.001, "backoff_base_s": 0, "ttl_s": 86400}],
    }
    config = load_config(registry=remote_registry, env={}, engine_extra={"kvplug": settings}).config
    assert config.copy_threads == 256 and config.store.queue.block_timeout_s == 3600
    assert load_config(registry=remote_registry, env={}, engine_extra={"kvplug": {"copy_threads": "auto"}})


def _numeric_fields(model: type) -> list[tuple[str, object]]:
    """``(name, FieldInfo)`` of the float and int fields of ``model`` (byte sizes and bools excepted)."""
    from pydantic import ByteSize

    from kvplug.core.components import _members

    fields = []
    for name, info in model.model_fields.items():
        kinds = [m for m in _members(info.annotation) if isinstance(m, type)]
        kinds += [a for m in _members(info.annotation) for a in getattr(m, "__args__", ())[:1] if isinstance(a, type)]
        if any(k is float or (k is int and not issubclass(k, (bool, ByteSize))) for k in kinds):
            fields.append((name, info))
    return fields


def test_no_float_or_int_setting_of_any_installed_component_takes_inf_nan_or_absurd_counts() -> None:
    """A sweep, so a field added later without a bound fails here: every float setting of the
    core and of every installed component refuses inf and nan, every int setting 2**62."""
    from typing import Annotated

    from pydantic import TypeAdapter, ValidationError

    from kvplug.core.config.model import KVPlugConfig, StoreSettings

    registry = PluginRegistry()
    models: list[type] = [KVPlugConfig, StoreSettings]
    for concern in ("serializer", "kv_connector", "storage_tier"):
        models += [component.Config for component in registry.components(concern).values()]
    accepted = []
    checked = 0
    for model in models:
        for name, info in _numeric_fields(model):
            adapter = TypeAdapter(Annotated[info.annotation, info])
            for bad in (INF, NAN, 2**62):
                checked += 1
                try:
                    adapter.validate_python(bad)
                except ValidationError:
                    continue
                accepted.append(f"{model.__name__}.{name} = {bad}")
    assert checked > 60
    assert not accepted, accepted


@pytest.mark.timeout(20)
def test_a_yaml_alias_bomb_is_refused_before_it_expands(full_registry: PluginRegistry, tmp_path: Path) -> None:
    """420 bytes of nested aliases made `kvplug config validate` run > 45 s
    and take ~850 MB. Aliases are refused at parse time, naming the first one."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    lines += ["tiers: [{type: cpu, max_bytes: *a8}]"]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size < 600
    _, text = problem_paths(full_registry, config_file=path)
    assert "aliases (*a0) are not allowed" in text


@pytest.mark.parametrize(
    ("text", "key", "line"),
    [
        ("serializer: {type: raw}\nchunk_size: 64\nserializer: {type: raw}\n", "serializer", 3),
        ("tiers:\n  - {type: cpu, max_bytes: 1GiB, max_bytes: 2GiB}\n", "max_bytes", 2),
    ],
    ids=["top-level", "in-a-tier"],
)
def test_a_key_given_twice_is_refused_naming_it(
    full_registry: PluginRegistry, tmp_path: Path, text: str, key: str, line: int
) -> None:
    """PyYAML keeps the last of two equal keys silently: docs/compression.md's example listed
    ``serializer: {type: zstd}`` then ``serializer: {type: int8}`` as alternatives, and a copy of
    it validated and ran the lossy int8 unnoticed. A repeated key is a YAML error naming it."""
    path = tmp_path / "twice.yaml"
    path.write_text(text)
    _, message = problem_paths(full_registry, config_file=path)
    assert f"key {key!r} is given twice" in message and f"line {line}," in message


def test_a_key_given_twice_in_an_env_json_value_is_refused(full_registry: PluginRegistry) -> None:
    """``KVPLUG_TIERS='[{"type": "cpu", "max_bytes": "1GiB", "max_bytes": "2GiB"}]'``: ``json``
    kept the last key silently, as PyYAML did in a file."""
    env = {"KVPLUG_TIERS": '[{"type": "cpu", "max_bytes": "1GiB", "max_bytes": "2GiB"}]'}
    paths, message = problem_paths(full_registry, env=env)
    assert paths == ["env KVPLUG_TIERS"], message
    assert "key 'max_bytes' is given twice" in message
