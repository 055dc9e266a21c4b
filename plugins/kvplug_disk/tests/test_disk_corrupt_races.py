"""A corrupt record is removed only if the folder still holds it: a good record another
process stored under its name since it was read must survive (tiers disk and shm, and
``kvplug store gc``)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from disk_worker import holding_the_folder_lock

from kvplug import RECORD_HEADER_SIZE, key_digest
from kvplug.cli.store import _check_all
from kvplug.testing import key_for, tier_context, value_for
from kvplug.testing.corrupt_races import (
    check_remove_if_same_keeps_a_newer_value,
    storing_after_gc_read,
    storing_before_corrupt_removal,
)
from kvplug_disk import DiskTier, ShmTier, verify_folder

KEY = key_for("raced")
VALUE = value_for("raced", 4000)


def store_from_another_process(kind: str, folder: Path) -> None:
    """Store KEY's good value from a separate Python process (its own tier, its own descriptors)."""
    code = textwrap.dedent(
        f"""
        from pathlib import Path
        from kvplug.testing import key_for, tier_context, value_for
        from kvplug_disk import DiskTier, ShmTier
        cls = {"ShmTier" if kind == "shm" else "DiskTier"}
        tier = cls(cls.Config(path=Path({str(folder)!r}), queue={{"mode": "sync"}}), tier_context())
        tier.put([(key_for("raced"), value_for("raced", 4000))])
        tier.flush()
        tier.close()
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def record_file(folder: Path) -> Path:
    digest = key_digest(KEY).hex()
    return folder / digest[:2] / f"{digest}.kvr"


def damage(folder: Path, *, truncate: bool = False) -> None:
    path = record_file(folder)
    data = bytearray(path.read_bytes())
    if truncate:  # a size the header rules out: found bad before it is read
        del data[RECORD_HEADER_SIZE + 10 :]
    else:
        data[RECORD_HEADER_SIZE + 100] ^= 1
    path.write_bytes(bytes(data))


def tier_class(kind: str) -> type[DiskTier]:
    return ShmTier if kind == "shm" else DiskTier


@pytest.fixture
def folder(kind: str, tmp_path: Path, shm_dir: Path) -> Path:
    return (shm_dir if kind == "shm" else tmp_path) / "cache"


@pytest.mark.parametrize("truncate", [False, True], ids=["flipped-bit", "truncated"])
def test_a_good_record_stored_after_the_corrupt_read_is_not_deleted(kind: str, folder: Path, truncate: bool) -> None:
    cls = tier_class(kind)
    stored_again: list[bool] = []

    def store_again() -> None:
        store_from_another_process(kind, folder)
        stored_again.append(True)

    RacedTier = storing_before_corrupt_removal(cls, store_again)
    tier = RacedTier(cls.Config(path=folder, queue={"mode": "sync"}), tier_context())
    try:
        tier.put([(KEY, VALUE)])
        damage(folder, truncate=truncate)
        assert tier.get([KEY]) == [None]
        assert stored_again and tier.stats().extra["corrupt"] == 1
        assert record_file(folder).exists(), "the good record another process stored was deleted"
        assert [bytes(v) for v in tier.get([KEY]) if v is not None] == [VALUE]
    finally:
        tier.close()


@pytest.mark.parametrize("truncate", [False, True], ids=["flipped-bit", "truncated"])
def test_a_corrupt_record_nobody_replaced_is_deleted_and_the_budget_freed(
    kind: str, folder: Path, truncate: bool
) -> None:
    cls = tier_class(kind)
    tier = cls(cls.Config(path=folder, queue={"mode": "sync"}), tier_context())
    try:
        tier.put([(KEY, VALUE)])
        damage(folder, truncate=truncate)
        assert tier.get([KEY]) == [None]
        assert not record_file(folder).exists()
        if not truncate:  # (cut in place, behind the ledger's back, the file no longer says what it counted)
            assert tier.stats().extra["folder_bytes"] == 0
        assert tier.contains([KEY]) == [False]
    finally:
        tier.close()


def test_gc_keeps_a_good_record_stored_after_it_read_the_corrupt_one(kind: str, folder: Path) -> None:
    cls = tier_class(kind)
    writer = cls(cls.Config(path=folder, queue={"mode": "sync"}), tier_context())
    writer.put([(KEY, VALUE)])
    writer.close()
    damage(folder)

    RacedTier = storing_after_gc_read(cls, lambda: store_from_another_process(kind, folder))
    tier = RacedTier(cls.Config(path=folder, max_bytes=1 << 40), tier_context())
    try:
        verdicts = _check_all(tier, remove=True)
    finally:
        tier.close()
    assert verdicts["corrupt"] == 1 and verdicts["removed"] == 0
    assert record_file(folder).exists(), "gc deleted the good record stored after its read"
    reader = cls(cls.Config(path=folder, queue={"mode": "sync"}), tier_context())
    try:
        assert [bytes(v) for v in reader.get([KEY]) if v is not None] == [VALUE]
    finally:
        reader.close()


def test_a_read_of_a_corrupt_record_does_not_wait_for_a_paused_process_holding_the_folder(
    kind: str, folder: Path
) -> None:
    """Another process stopped while it holds the folder's lock (SIGSTOP, a debugger, a paused
    container): a read that finds a corrupt record answers (a miss) instead of waiting to remove
    it; the record is removed by a read once the folder is free."""
    cls = tier_class(kind)
    tier = cls(cls.Config(path=folder, queue={"mode": "sync"}), tier_context())
    holder = None
    try:
        tier.put([(KEY, VALUE)])
        damage(folder)
        holder = holding_the_folder_lock(folder)
        answers: list[object] = []
        reader = threading.Thread(target=lambda: answers.append(tier.get([KEY])), daemon=True)
        reader.start()
        reader.join(60)
        assert answers == [[None]], "a read waited for another process's lock on the folder"
        assert record_file(folder).exists() and tier.contains([KEY]) == [False]
        holder.kill()
        holder.wait(30)
        holder = None
        assert tier.get([KEY]) == [None]
        assert not record_file(folder).exists()
    finally:
        if holder is not None:
            holder.kill()
            holder.wait(30)
        tier.close()


def test_verify_folder_removing_a_corrupt_record_frees_its_bytes_in_the_folder_budget(kind: str, folder: Path) -> None:
    """``verify_folder(remove_corrupt=True)`` beside a running tier: the bytes of what it removed
    leave the folder's shared total, so the tier's next write evicts no good record for them."""
    cls = tier_class(kind)
    tier = cls(cls.Config(path=folder, max_bytes=40_000, queue={"mode": "sync"}), tier_context())
    try:
        keys = [key_for(f"budget-{i}") for i in range(4)]
        tier.put([(key, value_for(key, 8000)) for key in keys])
        path = sorted(folder.glob("*/*.kvr"))[0]
        data = bytearray(path.read_bytes())
        data[RECORD_HEADER_SIZE + 100] ^= 1
        path.write_bytes(bytes(data))
        assert verify_folder(folder, remove_corrupt=True).removed == 1
        assert tier.stats().extra["folder_bytes"] == 3 * 8000
        tier.put([(KEY, value_for("raced", 12_000))])  # 24 000 + 12 000 fit in 40 000
        assert tier.stats().evictions == 0
        assert sum(tier.contains(keys)) == 3
    finally:
        tier.close()


def test_gc_waits_for_a_busy_folder_to_remove_a_corrupt_record(kind: str, folder: Path) -> None:
    """A read gives up on a busy folder's lock after a moment (the record stays); ``kvplug store
    gc`` waits for it instead, and removes the record."""
    cls = tier_class(kind)
    writer = cls(cls.Config(path=folder, queue={"mode": "sync"}), tier_context())
    writer.put([(KEY, VALUE)])
    writer.close()
    damage(folder)
    tier = cls(cls.Config(path=folder, max_bytes=1 << 40), tier_context())
    holder = holding_the_folder_lock(folder, hold_s=3)
    try:
        verdicts = _check_all(tier, remove=True)
    finally:
        holder.wait(60)
        tier.close()
    assert verdicts["corrupt"] == 1 and verdicts["removed"] == 1
    assert not record_file(folder).exists()


def test_remove_if_same_keeps_a_record_another_writer_stored_since_the_read(kind: str, tmp_path: Path) -> None:
    """A load's removal of a value it found unusable (the engine's checks, not the record's)."""
    cls = tier_class(kind)
    config = cls.Config(path=tmp_path / kind, queue={"mode": "sync"})
    tier, other = cls(config, tier_context()), cls(config, tier_context())  # another writer of the folder
    try:
        check_remove_if_same_keeps_a_newer_value(tier, other)
    finally:
        tier.close()
        other.close()


def test_remove_if_same_removes_a_record_damaged_in_place_that_trust_host_served(shm_dir: Path) -> None:
    """With ``trust_host`` the shm tier serves a value without its checksum: a byte changed in
    place reaches the engine, whose checks find it. The removal compares what the folder holds
    now (the record's own header, not one framed again from the value), so it goes."""
    tier = ShmTier(ShmTier.Config(path=shm_dir, trust_host=True, queue={"mode": "sync"}), tier_context())
    try:
        tier.put([(KEY, VALUE)])
        damage(shm_dir)  # a payload byte; the header keeps the old value checksum
        (served,) = tier.get([KEY])
        assert served is not None and bytes(served) != VALUE
        tier.remove_if_same([(KEY, bytes(served))])
        assert not record_file(shm_dir).exists()
        assert tier.contains([KEY]) == [False]
    finally:
        tier.close()
