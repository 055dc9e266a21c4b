"""Plugin discovery: plugins that are refused (built for another API, a component that does not
subclass its concern's base, a tier of an unknown medium), by name, while the others and every
command still work."""

from __future__ import annotations

import re
from pathlib import Path

from test_plugins import TIER_MODULE, make_distribution, run_kvplug

from kvplug import hookimpl
from kvplug.core.plugins import PluginRegistry
from kvplug_cpu import CPUTier


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
