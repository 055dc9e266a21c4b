"""The folder's shared byte total (``.kvplug-usage``) stays the value bytes of the records in the
folder through writes that fail half-way (tiers disk and shm)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvplug import key_digest
from kvplug.testing import key_for, tier_context, value_for
from kvplug_disk import DiskTier, ShmTier
from kvplug_disk.files import RecordFolder
from kvplug_disk.ledger import LEDGER_NAME, UsageLedger


def open_tier(kind: str, folder: Path) -> DiskTier:
    cls = ShmTier if kind == "shm" else DiskTier
    return cls(cls.Config(path=folder, queue={"mode": "sync"}), tier_context())


def folder_value_bytes(folder: Path) -> int:
    """Value bytes of the record files in the folder (each has a 64-byte header)."""
    return sum(path.stat().st_size - 64 for path in folder.glob("*/*.kvr") if path.is_file())


def ledger_total(folder: Path) -> int:
    return int.from_bytes((folder / LEDGER_NAME).read_bytes(), "little")


def test_a_write_whose_rename_fails_leaves_the_folder_total_as_it_was(kind: str, folder: Path) -> None:
    """The total is saved before the rename (a crash in between over-counts, never under-counts);
    a rename that fails (a folder appeared at the record's name) takes the value off again, in
    the file too, not only in this process's copy."""
    tier = open_tier(kind, folder)
    try:
        tier.put([(key_for("kept"), value_for("kept", 5000))])
        digest = key_digest(key_for("blocked")).hex()
        blocker = folder / digest[:2] / f"{digest}.kvr"
        blocker.mkdir()
        (blocker / "inside").write_bytes(b"x")  # a folder the rename cannot replace
        tier.put([(key_for("blocked"), value_for("blocked", 7000))])
        assert tier.stats().extra["dropped_puts"] == 1
        assert folder_value_bytes(folder) == 5000
        assert ledger_total(folder) == 5000
        assert tier.stats().extra["folder_bytes"] == 5000
    finally:
        tier.close()


def test_a_ledger_removed_under_running_tiers_is_one_ledger_again_for_every_process(kind: str, folder: Path) -> None:
    """The usage file removed while a tier runs (a cleanup of the folder): the running tier moves to
    the file a tier started since makes, so the two still exclude each other and keep one budget."""
    cls = ShmTier if kind == "shm" else DiskTier
    budget = 1_000_000

    def opened() -> DiskTier:  # each its own open file of the ledger: as separate processes
        return cls(cls.Config(path=folder, queue={"mode": "sync"}, max_bytes=budget), tier_context())

    first = opened()
    first.put([(key_for("first-0"), value_for("first-0", 100_000))])
    (folder / LEDGER_NAME).unlink()
    second = opened()
    try:
        write_in_turn_within(budget, folder, first, second, range(1, 20))
    finally:
        first.close()
        second.close()


def test_a_ledger_a_full_disk_kept_empty_is_rebuilt_not_taken_from_one_process(kind: str, small_tmpfs: Path) -> None:
    """Two processes open a folder on a full file system: neither can write the ledger's first
    8 bytes. Once there is room, the total they write is the folder's (a listing's), not the one
    process's own count that left out the other's records: the folder stays within max_bytes."""
    cls = ShmTier if kind == "shm" else DiskTier
    folder, budget = small_tmpfs / "store", 600_000
    filler = small_tmpfs / "filler"
    with filler.open("wb", buffering=0) as fill, pytest.raises(OSError, match="No space"):
        while True:
            fill.write(b"\0" * 4096)

    def opened() -> DiskTier:  # each its own open file of the ledger: as separate processes
        options: dict[str, object] = {"path": folder, "queue": {"mode": "sync"}, "max_bytes": budget}
        if kind == "disk":
            options["fsync"] = False
        return cls(cls.Config(**options), tier_context())

    first, second = opened(), opened()
    try:
        assert (folder / LEDGER_NAME).stat().st_size == 0
        filler.unlink()
        write_in_turn_within(budget, folder, first, second, range(8))
    finally:
        first.close()
        second.close()


def write_in_turn_within(budget: int, folder: Path, first: DiskTier, second: DiskTier, rounds: range) -> None:
    """Two processes' tiers of one folder write a 100 kB record each, in turn, for ``rounds``:
    the folder stays within ``budget`` and its ledger's total is what it holds."""
    for i in rounds:
        first.put([(key_for(f"first-{i}"), value_for(f"first-{i}", 100_000))])
        second.put([(key_for(f"second-{i}"), value_for(f"second-{i}", 100_000))])
    assert folder_value_bytes(folder) <= budget
    assert ledger_total(folder) == folder_value_bytes(folder)


def test_a_total_left_too_high_is_listed_before_the_process_evicts_all_it_knows(kind: str, folder: Path) -> None:
    """The folder's total says the budget is full beside what this process knows, but nothing else
    is in the folder (ten writes killed between their count and their rename, or a count a local
    user wrote): the process lists the folder, which says the records fit, before it evicts
    anything, not after it evicted every record it knew (6834e34: 5 evictions, 1 record left)."""
    cls = ShmTier if kind == "shm" else DiskTier
    tier = cls(cls.Config(path=folder, queue={"mode": "sync"}, max_bytes=10_000), tier_context())
    try:
        kept = [key_for(f"kept-{i}") for i in range(5)]
        for key in kept:
            tier.put([(key, value_for(key, 1000))])
        (folder / LEDGER_NAME).write_bytes((5000 + 10_000).to_bytes(8, "little"))
        tier.put([(key_for("new"), value_for("new", 1000))])
        assert tier.stats().evictions == 0
        assert folder_value_bytes(folder) == 6000
        assert ledger_total(folder) == 6000
    finally:
        tier.close()


def test_stats_racing_close_never_read_the_file_that_took_the_ledgers_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stats read the ledger without the folder's lock. A close() while one reads (held here at a
    gate in its read) must not free the descriptor under it: the next open in the process takes the
    number, and the read then returns that file's bytes as the folder's total (a591188: 999, the
    other file's, for the ledger's 4096)."""
    folder = RecordFolder(tmp_path / "cache", fsync=False)
    (folder.root / LEDGER_NAME).write_bytes((4096).to_bytes(8, "little"))  # the folder's total
    ledger = UsageLedger(folder.root_fd, where=str(folder.root))
    other = tmp_path / "other"
    other.write_bytes((999).to_bytes(8, "little"))
    real_pread = os.pread
    closers: list[threading.Thread] = []
    reused: list[int] = []

    def close_and_reuse(fd: int) -> None:
        ledger.close()
        taken = os.open(other, os.O_RDONLY)  # the next open in the process, at the freed number
        if taken != fd:
            os.dup2(taken, fd)
            os.close(taken)
        reused.append(fd)

    def pread(fd: int, size: int, offset: int) -> bytes:
        if threading.current_thread().name == "stats" and not closers:
            closers.append(threading.Thread(target=close_and_reuse, args=(fd,)))
            closers[0].start()
            # Fixed: close() waits for this read, and the join gives up; a591188: closed meanwhile.
            closers[0].join(1.0)
        return real_pread(fd, size, offset)

    read: list[int | BaseException] = []

    def stats() -> None:
        try:
            read.append(ledger.peek())
        except BaseException as exc:  # (said by the assertion below)
            read.append(exc)

    monkeypatch.setattr(os, "pread", pread)
    reader = threading.Thread(target=stats, name="stats")
    reader.start()
    reader.join(30.0)
    closers[0].join(30.0)
    monkeypatch.undo()
    for fd in reused:
        os.close(fd)
    folder.close()
    assert read == [4096], read
