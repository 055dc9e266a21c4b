"""Plugin discovery: builtins like plugins, KVPLUG_PLUGINS, duplicates and broken plugins."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvplug import hookimpl
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError, DuplicateComponentError
from kvplug_cpu import CPUTier


def make_distribution(
    site: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str], requires: tuple[str, ...] = ()
) -> None:
    """A real installed distribution on ``site``: a dist-info with entry points, and modules."""
    info = site / f"{dist.replace('-', '_')}-1.2.3.dist-info"
    info.mkdir(parents=True)
    requirements = "".join(f"Requires-Dist: {r}\n" for r in requires)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.2.3\n{requirements}")
    (info / "entry_points.txt").write_text("[kvplug]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    for name, code in modules.items():
        (site / f"{name}.py").write_text(code)


def run_kvplug(site: Path, *args: str, plugins: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]), COLUMNS="200")
    env.pop("KVPLUG_PLUGINS", None)
    if plugins is not None:
        env["KVPLUG_PLUGINS"] = plugins
    return subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", *args], env=env, capture_output=True, text=True, timeout=120
    )


TIER_MODULE = """
import kvplug
from kvplug_cpu import CPUTier

class {cls}(CPUTier):
    name = {name!r}

@kvplug.hookimpl
def kvplug_storage_tiers():
    return [{cls}]
"""


def test_builtins_are_registered_like_plugins() -> None:
    registry = PluginRegistry(plugin_filter="")
    assert set(registry.serializers()) == {"raw"} and set(registry.kv_connectors()) == {"torch"}
    assert registry.storage_tiers() == {}
    assert {p.distribution for p in registry.plugins()} == {"kvplug"}
    assert all(p.builtin for p in registry.plugins())


def test_kvplug_plugins_filters_entry_points() -> None:
    assert "cpu" in PluginRegistry(plugin_filter="cpu").storage_tiers()
    assert "cpu" not in PluginRegistry(plugin_filter="something-else").storage_tiers()


def test_cli_lists_plugins_and_respects_an_empty_filter(tmp_path: Path) -> None:
    listing = run_kvplug(tmp_path, "plugins")
    assert listing.returncode == 0, listing.stderr
    assert (
        "kvplug-cpu" in listing.stdout and "storage_tier: cpu" in listing.stdout and "serializer: raw" in listing.stdout
    )
    only_builtins = run_kvplug(tmp_path, "plugins", plugins="")
    assert "kvplug-cpu" not in only_builtins.stdout and "kv_connector: torch" in only_builtins.stdout


def test_two_components_with_one_name_name_both_distributions(tmp_path: Path) -> None:
    make_distribution(
        tmp_path, "kvplug-alpha", {"alpha": "alpha_tier"}, {"alpha_tier": TIER_MODULE.format(cls="A", name="shared")}
    )
    make_distribution(
        tmp_path, "kvplug-beta", {"beta": "beta_tier"}, {"beta_tier": TIER_MODULE.format(cls="B", name="shared")}
    )
    result = run_kvplug(tmp_path, "plugins")
    assert result.returncode == 1
    message = " ".join(result.stderr.split())
    assert "two storage_tier components are named 'shared'" in message
    assert "kvplug-alpha 1.2.3" in message and "kvplug-beta 1.2.3" in message
    # Limiting plugins resolves it.
    assert run_kvplug(tmp_path, "plugins", plugins="alpha,cpu").returncode == 0


def test_a_plugin_that_fails_to_import_is_reported_by_name(tmp_path: Path) -> None:
    make_distribution(
        tmp_path, "kvplug-broken", {"broken": "broken_tier"}, {"broken_tier": "import not_a_real_module\n"}
    )
    result = run_kvplug(tmp_path, "plugins")
    assert result.returncode == 1
    output = " ".join(result.stdout.split()) + " ".join(result.stderr.split())
    assert "plugin 'broken' (distribution kvplug-broken) failed to import" in output
    assert "No module named 'not_a_real_module'" in output
    assert "storage_tier: cpu" in result.stdout  # the other plugins still load


def test_unknown_type_mentions_plugins_that_failed(tmp_path: Path) -> None:
    make_distribution(
        tmp_path, "kvplug-broken", {"broken": "broken_tier"}, {"broken_tier": "raise RuntimeError('boom')\n"}
    )
    config = tmp_path / "c.yaml"
    config.write_text("tiers: [{type: fancy}]\n")
    result = run_kvplug(tmp_path, "config", "validate", str(config))
    message = " ".join(result.stderr.split())
    assert result.returncode == 2
    assert "tiers[0].type: unknown tier type 'fancy'" in message and "plugins that failed to load: broken" in message


def test_in_process_duplicate_and_invalid_components() -> None:
    class Twin:
        @staticmethod
        @hookimpl
        def kvplug_storage_tiers():
            return [CPUTier]

    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(Twin, "twin", distribution="kvplug-twin", version="9")
    with pytest.raises(DuplicateComponentError, match="kvplug-twin 9"):
        registry.storage_tiers()

    class Nameless:
        @staticmethod
        @hookimpl
        def kvplug_serializers():
            return [object]

    class Configless:
        @staticmethod
        @hookimpl
        def kvplug_serializers():
            class NoConfig:
                name = "no-config"

            return [NoConfig]

    # Each is refused by name, with the reason; the builtins' serializers still come back.
    registry = PluginRegistry(plugin_filter="")
    registry.register(Nameless, "nameless", distribution="kvplug-nameless", version="1")
    registry.register(Configless, "configless", distribution="kvplug-configless", version="1")
    assert {"raw"} <= set(registry.serializers()) and "no-config" not in registry.serializers()
    assert sorted(str(e) for e in registry.load_errors) == [
        "plugin 'configless' (distribution kvplug-configless) is not used: its serializer 'no-config' has no "
        "Config model",
        "plugin 'nameless' (distribution kvplug-nameless) is not used: kvplug_serializers() must return classes "
        "with a non-empty 'name' class attribute, got <class 'object'>",
    ]


def test_trace_logs_hook_calls(tmp_path: Path) -> None:
    code = "import logging; logging.basicConfig(level=logging.INFO); from kvplug.core.plugins import PluginRegistry; PluginRegistry().storage_tiers()"
    env = dict(os.environ, KVPLUG_TRACE_PLUGINS="1")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert "kvplug_storage_tiers [hook]" in result.stderr and "CPUTier" in result.stderr


def test_trace_shows_on_the_command_line() -> None:
    """docs/install.md: `KVPLUG_TRACE_PLUGINS=1` logs every hook call. `kvplug plugins` sets up
    no logging, and the trace (INFO) fell to Python's last-resort handler, which shows warnings
    only: the command printed no trace."""
    env = dict(os.environ, KVPLUG_TRACE_PLUGINS="1", KVPLUG_PLUGINS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "kvplug", "plugins"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "kvplug_storage_tiers [hook]" in result.stderr and "CPUTier" in result.stderr, result.stderr
    assert "kvplug_storage_tiers" not in result.stdout  # the table stays clean for a script


def test_events_reach_observers_and_their_errors_are_contained() -> None:
    seen = []

    class Observer:
        @staticmethod
        @hookimpl
        def kvplug_on_event(event):
            seen.append(event.kind)

    class Faulty:
        @staticmethod
        @hookimpl
        def kvplug_on_event(event):
            raise RuntimeError("observer bug")

    from kvplug import KVEvent

    registry = PluginRegistry(plugin_filter="")
    registry.register(Observer, "observer")
    registry.register(Faulty, "faulty")
    registry.emit(KVEvent("stored", ("k",)))
    assert seen == ["stored"]


def test_a_misspelled_hook_is_reported_by_name_and_the_others_load(tmp_path: Path) -> None:
    code = "import kvplug\n@kvplug.hookimpl\ndef kvplug_storage_tier():\n    return []\n"
    make_distribution(tmp_path, "kvplug-typo", {"typo": "typo_tier"}, {"typo_tier": code})
    result = run_kvplug(tmp_path, "plugins")
    output = " ".join(result.stdout.split()) + " ".join(result.stderr.split())
    assert result.returncode == 1
    assert "plugin 'typo' (distribution kvplug-typo) is not used" in output
    assert "kvplug_storage_tier" in output and "unknown hook" in output
    assert "storage_tier: cpu" in result.stdout


def test_a_hook_that_raises_is_reported_by_name_and_the_others_load(tmp_path: Path) -> None:
    code = "import kvplug\n@kvplug.hookimpl\ndef kvplug_storage_tiers():\n    raise RuntimeError('disk on fire')\n"
    make_distribution(tmp_path, "kvplug-raises", {"raises": "raising_tier"}, {"raising_tier": code})
    result = run_kvplug(tmp_path, "plugins")
    output = " ".join(result.stdout.split()) + " ".join(result.stderr.split())
    assert result.returncode == 1
    assert "plugin 'raises' (distribution kvplug-raises) is not used" in output
    assert "kvplug_storage_tiers() raised RuntimeError: disk on fire" in output
    assert "storage_tier: cpu" in result.stdout


@pytest.mark.parametrize("value", ["false", "off", "No"])
def test_trace_off_in_words_traces_nothing(value: str) -> None:
    """Anything but "" or "0" turned the trace on: KVPLUG_TRACE_PLUGINS=false logged every hook call."""
    env = dict(os.environ, KVPLUG_TRACE_PLUGINS=value, KVPLUG_PLUGINS="cpu")
    result = subprocess.run(
        [sys.executable, "-m", "kvplug", "plugins"], env=env, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert "[hook]" not in result.stderr, result.stderr


def test_trace_value_that_is_no_flag_is_refused_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVPLUG_TRACE_PLUGINS", "verbose")
    with pytest.raises(ConfigError, match=r"env KVPLUG_TRACE_PLUGINS: must be 1, true, yes or on .*\(got 'verbose'\)"):
        PluginRegistry(load_entry_points=False)
