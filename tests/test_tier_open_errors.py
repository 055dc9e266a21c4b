"""A tier whose constructor fails is a config error naming its ``tiers[i]`` entry."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import pytest
from core_helpers import LAYOUTS

from kvplug import CacheEngine, Fingerprint, StorageTier, TierChain, TierStats, hookimpl, load_config
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError, TierOpenError


class _ClosingTier(StorageTier):
    """A tier that remembers being closed (opened ahead of the one that fails)."""

    name = "closing"
    closed: ClassVar[list[bool]] = []

    def contains(self, keys):
        return [False] * len(keys)

    def get(self, keys):
        return [None] * len(keys)

    def put(self, items) -> None:
        pass

    def remove(self, keys) -> None:
        pass

    def stats(self) -> TierStats:
        return TierStats()

    def close(self) -> None:
        self.closed.append(True)


class _UnreachableTier(_ClosingTier):
    """A third-party tier that cannot reach its store at start-up (credentials in the URL)."""

    name = "unreachable"

    def __init__(self, config, context) -> None:
        raise ConnectionError("cannot reach https://user:hunter2@store.example:9000 (connection refused)")


class _Plugin:
    @staticmethod
    @hookimpl
    def kvplug_storage_tiers():
        return [_ClosingTier, _UnreachableTier]


def _engine(tiers: list[dict], registry: PluginRegistry) -> CacheEngine:
    config = load_config(engine_extra={"kvplug": {"chunk_size": 8, "tiers": tiers}}, env={}, registry=registry).config
    layout = LAYOUTS["sglang_mha"]
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry)


def test_a_disk_tier_that_cannot_create_its_folder_names_its_entry(tmp_path: Path) -> None:
    registry = PluginRegistry(plugin_filter="cpu,disk")
    registry.register(_Plugin, "closing-test")
    (tmp_path / "a-file").write_text("not a folder")
    path = tmp_path / "a-file" / "cache"  # its parent is a file: mkdir fails for root too
    _ClosingTier.closed.clear()
    with pytest.raises(TierOpenError) as caught:
        _engine([{"type": "closing"}, {"type": "disk", "path": str(path), "max_bytes": "1MiB"}], registry)
    error = caught.value
    assert isinstance(error, ConfigError)  # callers that catch config errors get it too
    assert (error.index, error.tier_type) == (1, "disk")
    assert isinstance(error.cause, OSError)
    assert [p.path for p in error.problems] == ["tiers[1]"]
    message = str(error)
    assert message.startswith("kvplug config tiers[1] (type disk): cannot open the tier: ")
    assert str(tmp_path / "a-file") in message and "\n" not in message
    assert error.__cause__ is None and error.__suppress_context__  # one error, not two tracebacks
    assert _ClosingTier.closed == [True]  # the tier opened before it was closed again


def test_a_third_party_tier_constructor_failure_names_its_entry_without_credentials() -> None:
    registry = PluginRegistry(plugin_filter="cpu")
    registry.register(_Plugin, "closing-test")
    with pytest.raises(TierOpenError) as caught:
        _engine([{"type": "cpu", "max_bytes": "1MiB"}, {"type": "unreachable"}], registry)
    message = str(caught.value)
    assert message.startswith("kvplug config tiers[1] (type unreachable): cannot open the tier: ConnectionError: ")
    assert "connection refused" in message
    assert "hunter2" not in message and "hunter2" not in str(caught.value.problems[0])


def test_preflight_names_a_disk_folder_that_cannot_be_made_and_creates_nothing(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    registry = PluginRegistry()
    tiers = [{"type": "cpu", "max_bytes": "1MiB"}, {"type": "disk", "path": str(blocker / "sub" / "cache")}]
    config = load_config(engine_extra={"kvplug": {"tiers": tiers}}, env={}, registry=registry).config
    with pytest.raises(TierOpenError, match=r"tiers\[1\] \(type disk\): cannot open the tier: ValueError: ") as info:
        TierChain.preflight(config.tiers, registry)
    assert f"{blocker} is not a folder" in str(info.value)
    assert not (blocker / "sub").exists()

    good = tmp_path / "new" / "cache"
    config = load_config(
        engine_extra={"kvplug": {"tiers": [{"type": "disk", "path": str(good)}]}}, env={}, registry=registry
    )
    TierChain.preflight(config.config.tiers, registry)
    assert not good.parent.exists()  # checked, not created

    read_only = tmp_path / "read-only"
    read_only.mkdir()
    read_only.chmod(0o500)
    try:
        config = load_config(
            engine_extra={"kvplug": {"tiers": [{"type": "disk", "path": str(read_only / "cache")}]}},
            env={},
            registry=registry,
        )
        if os.geteuid() != 0:  # root writes anywhere: the access check passes, as the mkdir would
            with pytest.raises(TierOpenError, match="is not writable by this process"):
                TierChain.preflight(config.config.tiers, registry)
    finally:
        read_only.chmod(0o700)


@pytest.mark.parametrize("folder", ["/proc/kvplug-nope", "/sys/kvplug-nope/cache"])
def test_preflight_refuses_a_folder_on_a_kernel_file_system_even_as_root(folder: str) -> None:
    """``os.access`` says root may write ``/proc``; the mkdir then fails, after the model loaded."""
    registry = PluginRegistry()
    config = load_config(
        engine_extra={"kvplug": {"tiers": [{"type": "disk", "path": folder}]}}, env={}, registry=registry
    ).config
    with pytest.raises(
        TierOpenError,
        match=r"tiers\[0\] \(type disk\): .* (is on the kernel's (proc|sysfs) file system|is not writable by this)",
    ):
        TierChain.preflight(config.tiers, registry)


def test_config_validate_runs_the_tiers_preflight_and_writes_nothing(tmp_path: Path) -> None:
    """``kvplug config validate`` said ok for a disk tier at /proc/kvplug-nope; the server then died
    after loading its model."""
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc_words = "kernel's proc file system" if os.geteuid() == 0 else "is not writable by this process"
    for bad, words in (("/proc/kvplug-nope", proc_words), (str(blocker / "cache"), "is not a folder")):
        config = tmp_path / "kvplug.yaml"
        config.write_text(f"tiers:\n  - {{type: cpu, max_bytes: 1GiB}}\n  - {{type: disk, path: '{bad}'}}\n")
        done = subprocess.run(
            [sys.executable, "-c", "from kvplug.cli.main import app; app()", "config", "validate", str(config)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 2, done
        assert "tiers[1] (type disk): cannot open the tier" in done.stderr and words in done.stderr, done.stderr
    assert not Path("/proc/kvplug-nope").exists() and sorted(p.name for p in tmp_path.iterdir()) == [
        "a-file",
        "kvplug.yaml",
    ]
