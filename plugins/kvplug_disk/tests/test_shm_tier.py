"""Tier ``shm`` against the storage contract, plus what is specific to it: reads are
views of mapped record files, nothing is fsynced, the file system is checked."""

from __future__ import annotations

import logging
import mmap
import stat
import tracemalloc
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvplug import RECORD_HEADER_SIZE, get_registry, key_digest
from kvplug.testing import StorageTierContract, key_for, tier_context, value_for
from kvplug_disk import ShmTier
from kvplug_disk.config import DEFAULT_SHM_PATH
from kvplug_disk.mounts import file_system_of, huge_pages_of


def make_shm_tier(path: Path, max_bytes: int | None = None, **options: object) -> ShmTier:
    if max_bytes is not None:
        options["max_bytes"] = max_bytes
    return ShmTier(ShmTier.Config(path=path, **options), tier_context())


class TestShmTierContract(StorageTierContract):
    large_value_bytes = 8 * 1024 * 1024
    concurrency_seconds = 1.0

    @pytest.fixture
    def make_tier(self, shm_dir: Path):
        return lambda max_bytes=None: make_shm_tier(shm_dir / "cache", max_bytes)


def test_a_read_is_a_view_of_the_mapped_record_not_a_copy(shm_dir: Path) -> None:
    size = 4 * 1024 * 1024
    tier = make_shm_tier(shm_dir)
    try:
        tier.put([(key_for("big"), value_for("big", size))])
        tracemalloc.start()
        try:
            (value,) = tier.get([key_for("big")])
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert isinstance(value, memoryview) and value.readonly
        assert isinstance(value.obj, mmap.mmap), f"the value is over a {type(value.obj).__name__}, not a mapping"
        assert peak < size // 8, f"get allocated {peak} bytes for a {size}-byte value: a copy"
        assert value == value_for("big", size)
        assert tier.stats().extra["map_fallbacks"] == 0
    finally:
        tier.close()


def test_the_checksum_is_verified_over_the_mapping(shm_dir: Path) -> None:
    """A record whose bytes changed on tmpfs is a miss, counted as corrupt and removed."""
    tier = make_shm_tier(shm_dir)
    try:
        tier.put([(key_for("x"), value_for("x", 10_000))])
        (record,) = shm_dir.glob("*/*.kvr")
        data = bytearray(record.read_bytes())
        data[RECORD_HEADER_SIZE + 5000] ^= 0xFF
        record.write_bytes(data)  # in place, as only something other than kvplug would
        assert tier.get([key_for("x")]) == [None]
        assert tier.stats().extra["corrupt"] == 1 and not record.exists()
    finally:
        tier.close()


def test_trust_host_skips_only_the_value_checksum(shm_dir: Path) -> None:
    """trust_host: the value's checksum is not computed (docs/security.md says when that
    is sound), but a record under another key or a cut record is still a miss."""
    tier = make_shm_tier(shm_dir, trust_host=True)
    try:
        tier.put([(key_for("x"), value_for("x", 10_000)), (key_for("y"), value_for("y", 10_000))])
        records = {path.stem: path for path in shm_dir.glob("*/*.kvr")}
        x, y = (records[key_digest(key_for(name)).hex()] for name in ("x", "y"))
        data = bytearray(x.read_bytes())
        data[RECORD_HEADER_SIZE + 5000] ^= 0xFF
        x.write_bytes(data)  # the value changed in place: not checked, by the operator's choice
        assert tier.get([key_for("x")])[0] == bytes(data[RECORD_HEADER_SIZE:])
        y.write_bytes(y.read_bytes()[:-1])  # cut short: the header's length says otherwise
        z = key_digest(key_for("z")).hex()
        (shm_dir / z[:2]).mkdir(exist_ok=True)
        x.rename(shm_dir / z[:2] / f"{z}.kvr")  # x's record where z's belongs: stored under another key
        assert tier.get([key_for("y"), key_for("z")]) == [None, None]
        assert tier.stats().extra["corrupt"] == 2
    finally:
        tier.close()


def test_tier_shm_is_registered_and_declares_host_memory() -> None:
    assert get_registry().storage_tiers()["shm"] is ShmTier
    assert ShmTier.medium == "memory" and not ShmTier.trusted_reads and not ShmTier.keeps_buffers


def test_defaults_are_dev_shm_and_no_fsync() -> None:
    config = ShmTier.Config()
    assert config.path == DEFAULT_SHM_PATH == Path("/dev/shm/kvplug")
    assert config.fsync is False and config.write_threads == 1
    with pytest.raises(ValidationError, match="fsync"):
        ShmTier.Config(fsync=True)


def test_no_fsync_is_called(shm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    synced: list[int] = []
    for name in ("fsync", "fdatasync"):
        if hasattr(os, name):
            real = getattr(os, name)
            monkeypatch.setattr(os, name, lambda fd, real=real: synced.append(fd) or real(fd))
    tier = make_shm_tier(shm_dir)
    try:
        tier.put([(key_for(f"k{i}"), value_for(f"k{i}", 1000)) for i in range(20)])
        tier.flush()
    finally:
        tier.close()
    assert synced == []
    assert len(list(shm_dir.glob("*/*.kvr"))) == 20 and not list(shm_dir.glob("*/*.tmp"))


def test_the_file_system_of_a_path_is_its_deepest_mount(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "overlay / overlay rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "/dev/sda1 /dev/shm/disk\\040dir ext4 rw 0 0\n"  # a space in a mount point is escaped
        "tmpfs /mnt/over ext4 rw 0 0\n"
        "tmpfs /mnt/over ramfs rw 0 0\n"  # mounted over the last: it is what a path there reaches
    )
    assert file_system_of(Path("/dev/shm/kvplug"), str(mounts)) == "tmpfs"
    assert file_system_of(Path("/dev/shm/disk dir/x"), str(mounts)) == "ext4"
    assert file_system_of(Path("/dev/shmx"), str(mounts)) == "overlay"
    assert file_system_of(Path("/mnt/over/a"), str(mounts)) == "ramfs"
    assert file_system_of(Path("/x"), str(tmp_path / "absent")) == "unknown"


def test_huge_pages_are_the_mount_option_unless_the_host_forces_or_denies_them(tmp_path: Path) -> None:
    mounts, host = tmp_path / "mounts", tmp_path / "shmem_enabled"
    mounts.write_text(
        "tmpfs /dev/shm tmpfs rw,nosuid,nodev 0 0\n"
        "tmpfs /mnt/kv tmpfs rw,size=64g,huge=always 0 0\n"
        "/dev/sda1 /data ext4 rw 0 0\n"
    )
    host.write_text("always within_size advise [never] deny force\n")
    huge = {p: huge_pages_of(Path(p), str(mounts), str(host)) for p in ("/dev/shm/a", "/mnt/kv/a", "/data/a")}
    assert huge == {"/dev/shm/a": "never", "/mnt/kv/a": "always", "/data/a": "-"}
    host.write_text("always within_size advise never deny [force]\n")
    assert huge_pages_of(Path("/dev/shm/a"), str(mounts), str(host)) == "always"
    host.write_text("always within_size advise never [deny] force\n")
    assert huge_pages_of(Path("/mnt/kv/a"), str(mounts), str(host)) == "never"
    assert huge_pages_of(Path("/mnt/kv/a"), str(mounts), str(tmp_path / "absent")) == "always"


def test_a_folder_off_tmpfs_is_warned_about_once_and_still_works(
    tmp_path: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for folder in (tmp_path / "cache", shm_dir / "cache"):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            tier = make_shm_tier(folder)
        try:
            tier.put([(key_for("a"), b"abc")])
            assert bytes(tier.get([key_for("a")])[0] or b"") == b"abc"
            found = tier.stats().extra["file_system"]
        finally:
            tier.close()
        assert found == file_system_of(folder)
        warnings = [r.getMessage() for r in caplog.records if "not tmpfs" in r.getMessage()]
        if found in ("tmpfs", "ramfs"):
            assert warnings == []
        else:
            assert len(warnings) == 1 and str(folder) in warnings[0] and found in warnings[0]


def test_a_folder_others_may_write_is_refused_and_a_new_one_is_private(shm_dir: Path) -> None:
    new = shm_dir / "new" / "cache"
    make_shm_tier(new).close()
    assert stat.S_IMODE(new.stat().st_mode) & 0o077 == 0  # made 0700 (less the umask)
    open_to_all = shm_dir / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)
    with pytest.raises(ValueError, match=r"others may read or write it \(mode 0777"):
        ShmTier.preflight(ShmTier.Config(path=open_to_all))
    with pytest.raises(PermissionError, match="others may read or write it") as refused:
        make_shm_tier(open_to_all)
    assert refused.value.filename == str(open_to_all)
    assert list(open_to_all.iterdir()) == []  # refused before anything was scanned, cleaned or made
    open_to_all.chmod(0o700)
    ShmTier.preflight(ShmTier.Config(path=open_to_all))
    make_shm_tier(open_to_all).close()


def test_a_folder_others_may_read_is_refused(shm_dir: Path) -> None:
    """A folder pre-made 0755 held records another user could read (prompts)."""
    readable = shm_dir / "readable"
    readable.mkdir(mode=0o755)
    readable.chmod(0o755)
    with pytest.raises(ValueError, match=r"others may read or write it \(mode 0755"):
        ShmTier.preflight(ShmTier.Config(path=readable))
    with pytest.raises(PermissionError, match="others may read or write it"):
        make_shm_tier(readable)
    assert list(readable.iterdir()) == []


def test_a_link_at_the_path_is_refused_before_anything_is_written(shm_dir: Path, tmp_path: Path) -> None:
    """A symbolic link planted at the configured path (by another user, to a
    folder they can read) received the tier's records. Refused, however private its target."""
    target = tmp_path / "planted"
    target.mkdir(mode=0o700)
    link = shm_dir / "kvplug"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        ShmTier.preflight(ShmTier.Config(path=link))
    with pytest.raises(PermissionError, match="symbolic link") as refused:
        make_shm_tier(link)
    assert refused.value.filename == str(link)
    assert list(target.iterdir()) == []
