"""Plugin discovery: builtins like plugins, KVPLUG_PLUGINS, duplicates and broken plugins."""

from __future__ import annotations

import os
import re
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


def test_a_plugin_built_for_another_api_is_refused_naming_both_versions(tmp_path: Path) -> None:
    import kvplug

    make_distribution(
        tmp_path,
        "kvplug-ancient",
        {"ancient": "ancient_tier"},
        {"ancient_tier": TIER_MODULE.format(cls="AncientTier", name="ancient")},
        requires=("kvplug>=0.1,<0.2",),
    )
    make_distribution(
        tmp_path,
        "kvplug-current",
        {"current": "current_tier"},
        {"current_tier": TIER_MODULE.format(cls="CurrentTier", name="current")},
        requires=(f"kvplug>={kvplug.__version__}",),
    )
    result = run_kvplug(tmp_path, "plugins")
    output = " ".join(result.stdout.split()) + " ".join(result.stderr.split())
    assert result.returncode == 1
    assert "plugin 'ancient' (distribution kvplug-ancient) is not used" in output
    assert f"built for kvplug<0.2,>=0.1 (plugin API), and this is kvplug {kvplug.__version__}" in output
    assert "storage_tier: current" in result.stdout and "storage_tier: ancient" not in result.stdout


#: A tier written as 0.1's guide allowed: a plain class with the tier methods, not a
#: ``kvplug.StorageTier`` subclass (so none of the base's optional methods and attributes).
LOOK_ALIKE_TIER = """
import kvplug
from kvplug import TierConfig, TierStats

class MemoTier:
    name = "memo"
    Config = TierConfig

    def __init__(self, config, context):
        self.values = {}
    def contains(self, keys):
        return [k in self.values for k in keys]
    def get(self, keys):
        return [self.values.get(k) for k in keys]
    def put(self, items):
        self.values.update(items)
    def remove(self, keys):
        for k in keys:
            self.values.pop(k, None)
    def stats(self):
        return TierStats(items=len(self.values))
    def close(self):
        pass

@kvplug.hookimpl
def kvplug_storage_tiers():
    return [MemoTier]
"""


def test_a_look_alike_tier_is_refused_and_every_command_still_works(tmp_path: Path, monkeypatch) -> None:
    """A non-``StorageTier`` tier installed next to kvplug made every
    ``kvplug store`` command crash (``MemoTier has no attribute 'location_config'``), even on
    a disk store. It is refused by name with the reason; the other plugins and every command work."""
    site = tmp_path / "site"
    make_distribution(site, "kvplug-memo", {"memo": "memo_look_alike_tier"}, {"memo_look_alike_tier": LOOK_ALIKE_TIER})
    refused = "plugin 'memo' (distribution kvplug-memo) is not used: its storage tier 'memo' (class memo_look_alike_tier.MemoTier) does not subclass kvplug.StorageTier"

    # The real command line, in a process of its own: the plugin is found by entry-point discovery.
    listing = run_kvplug(site, "plugins")
    output = " ".join(listing.stdout.split()) + " " + " ".join(listing.stderr.split())
    assert listing.returncode == 1, output  # a refused plugin is an error, as for an API mismatch
    assert refused in output, output
    assert "storage_tier: cpu, disk" in output or ("storage_tier: cpu" in output and "storage_tier: disk" in output)
    assert "Traceback" not in listing.stderr

    assert_every_command_works(site, "memo", refused, monkeypatch, tmp_path)


def assert_every_command_works(site: Path, tier: str, refused: str, monkeypatch, tmp_path: Path) -> None:
    """Every CLI command, in this process, with the refused plugin of tier type ``tier`` on sys.path."""
    from test_store_cli import fill_store
    from typer.testing import CliRunner

    from kvplug.cli.main import app
    from kvplug.core import plugins

    folder = tmp_path / "cache"
    fill_store(folder, prompts=2)
    config = tmp_path / "disk.yaml"
    config.write_text(f"tiers: [{{type: disk, path: {folder}}}]\n")
    tier_config = tmp_path / f"{tier}.yaml"
    tier_config.write_text(f"tiers: [{{type: {tier}}}]\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("KVPLUG_PLUGINS", raising=False)
    plugins.get_registry.cache_clear()
    try:
        assert tier not in plugins.get_registry().storage_tiers()
        assert "raw" in plugins.get_registry().serializers()
        assert any(refused in str(e) for e in plugins.get_registry().load_errors)
        runner = CliRunner()
        expected = {
            ("--help",): 0,
            ("config", "show", "-f", str(config)): 0,
            ("config", "validate", str(config)): 0,
            ("store", "stats", str(folder)): 0,
            ("store", "ls", str(folder)): 0,
            ("store", "verify", str(folder)): 0,
            ("store", "gc", str(folder)): 0,
            ("demo", "--engine", "synthetic", "--tokens", "256"): 0,
            ("config", "validate", str(tier_config)): 2,
        }
        for args, code in expected.items():
            result = runner.invoke(app, list(args), terminal_width=250)
            assert result.exit_code == code, (args, result.output, result.exception)
            assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
        stats = runner.invoke(app, ["store", "stats", str(folder)], terminal_width=250)
        # 4 chunks and the fingerprint manifest the engine writes with them
        assert re.search(r"(│ records\s*│\s*5 │|^records: 5$)", stats.output, re.M), stats.output
        unknown = " ".join(
            runner.invoke(app, ["config", "validate", str(tier_config)], terminal_width=250).output.split()
        )
        assert f"unknown tier type '{tier}'" in unknown and f"plugins that failed to load: {tier}" in unknown
    finally:
        plugins.get_registry.cache_clear()


SSD_TIER = """
import kvplug
from kvplug_cpu import CPUTier

class SsdTier(CPUTier):
    name = "ssd"
    medium = "ssd"

@kvplug.hookimpl
def kvplug_storage_tiers():
    return [SsdTier]
"""


def test_a_tier_of_an_unknown_medium_is_refused_and_every_command_still_works(tmp_path: Path, monkeypatch) -> None:
    """A tier declaring ``medium = "ssd"`` raised ``InvalidComponentError`` out of ``components()``,
    taking down ``serializers()`` and every command; now its plugin alone is refused, by name."""
    site = tmp_path / "site"
    make_distribution(site, "kvplug-ssd", {"ssd": "ssd_medium_tier"}, {"ssd_medium_tier": SSD_TIER})
    refused = (
        "plugin 'ssd' (distribution kvplug-ssd) is not used: its storage tier 'ssd' declares medium 'ssd'; "
        "a tier's medium is one of memory, disk, remote"
    )
    listing = run_kvplug(site, "plugins")
    output = " ".join(listing.stdout.split()) + " " + " ".join(listing.stderr.split())
    assert listing.returncode == 1, output
    assert refused in output, output
    assert "storage_tier: cpu, disk" in output or ("storage_tier: cpu" in output and "storage_tier: disk" in output)
    assert "Traceback" not in listing.stderr
    assert_every_command_works(site, "ssd", refused, monkeypatch, tmp_path)


def test_a_plugin_with_one_look_alike_component_provides_none() -> None:
    """The rule: every component subclasses its concern's base; a plugin that breaks it is not used at all."""
    from kvplug.core.plugins import CONCERN_BASES, CONCERN_HOOKS

    class Mixed:
        @staticmethod
        @hookimpl
        def kvplug_storage_tiers():
            class Good(CPUTier):
                name = "good"

            class Plain:
                name = "plain"
                Config = CPUTier.Config

            return [Good, Plain]

    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(Mixed, "mixed", distribution="kvplug-mixed", version="1")
    assert set(registry.storage_tiers()) == {"cpu"}
    [error] = registry.load_errors
    assert "plugin 'mixed' (distribution kvplug-mixed) is not used" in str(error)
    assert "Plain) does not subclass kvplug.StorageTier" in str(error)
    assert set(CONCERN_BASES) == set(CONCERN_HOOKS)  # every concern has its base


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
