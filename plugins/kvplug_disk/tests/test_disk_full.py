"""Tier ``disk`` on a full disk: a real small tmpfs, so ENOSPC is the kernel's own."""

from __future__ import annotations

import errno
import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_disk_hostile import make_disk_tier, temp_files

from kvplug import TierChain
from kvplug.core.metrics import EngineMetrics
from kvplug.testing import key_for, tier_context, value_for
from kvplug_disk import DiskTier

# --- a full disk ------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB file system (tmpfs), so ENOSPC is the kernel's own."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip(f"mounting a small tmpfs needs root (CI runs as root): {mounted.stderr.strip()}")
        pytest.fail(f"cannot mount a 4 MiB tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_evicts_the_tiers_own_records_to_make_room(small_fs: Path) -> None:
    tier = make_disk_tier(small_fs / "cache", 64 * 1024**2)  # budget far above the disk
    keys = [key_for(f"full{i}") for i in range(40)]
    for key in keys:  # 8 MB through a 4 MiB disk
        tier.put([(key, value_for(key, 200_000))])
        assert tier.contains([key]) == [True], key
        assert bytes(tier.get([key])[0]) == value_for(key, 200_000)
    stats = tier.stats()
    assert stats.errors == 0 and stats.extra["enospc_evictions"] > 0 and stats.evictions > 0
    assert 5 < stats.items < 21
    assert temp_files(small_fs) == []
    tier.close()


def test_a_disk_full_of_other_data_counts_errors_in_prometheus_and_warns_once_per_burst(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (small_fs / "other").open("wb", buffering=0) as filler:  # someone else's data fills the disk
        try:
            while True:
                filler.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    (small_fs / "other").unlink()
    (small_fs / "other").write_bytes(b"\0" * (4 * 1024**2 - 150_000))  # leaves room for the tier's folders only
    metrics = EngineMetrics()
    config = DiskTier.Config(path=small_fs / "cache", max_bytes=64 * 1024**2)
    chain = TierChain([DiskTier(config, tier_context(metrics=metrics))], metrics)
    caplog.set_level(logging.WARNING)
    for i in range(12):
        chain.put([(key_for(f"nospace{i}"), value_for(f"nospace{i}", 200_000))])
    chain.flush()
    stats = chain.tiers[0].stats()
    assert stats.errors == 12 and stats.extra["enospc"] == 12 and stats.items == 0
    assert metrics.value("kvplug_tier_errors_total", tier="0:disk", op="write") == 12
    warnings = [r for r in caplog.records if "No space left" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert temp_files(small_fs) == []
    chain.close()


def test_a_tier_opened_on_a_full_disk_starts_and_counts_its_failed_writes(small_fs: Path) -> None:
    with (small_fs / "other").open("wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    tier = make_disk_tier(small_fs / "cache", 64 * 1024**2)
    tier.put([(key_for("no room"), value_for("no room", 100_000))])
    assert tier.contains([key_for("no room")]) == [False]
    assert tier.stats().extra["enospc"] == 1
    (small_fs / "other").unlink()  # room again: the tier works, and its shared total with it
    tier.put([(key_for("room"), value_for("room", 100_000))])
    assert tier.contains([key_for("room")]) == [True]
    assert tier.stats().extra["folder_bytes"] == 100_000
    tier.close()
