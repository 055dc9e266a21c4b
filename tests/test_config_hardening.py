"""Issue 14 item 7: values that ``config validate`` used to accept and that then failed or did nothing.

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
        ({"store": {"queue_max_batches": False}}, "store.queue_max_batches", "not a boolean"),
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
