"""The edges of folder pins (:mod:`kvplug_disk.pin_marks`): an unpin that cannot take the folder's
lock, an owner's lock file left half made by a crash, and records kept for other engines that a
third process removed. The helpers and workers are in :mod:`pinned_folders`."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest
from pinned_folders import FILE, PINNED, QUOTA, during_carry_over, marks_on, path_of, records, start, tier_of
from tenant_worker import VALUE, Worker

from kvplug.core.tenants import FOLDER_TENANT_BYTES
from kvplug.testing import value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk.pin_marks import OWNERS_FOLDER


def test_an_unpin_that_cannot_take_the_folders_lock_leaves_no_mark_for_good(
    kind: str, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A pins a record; engine B stores it again and, having copied the old file's marks
    onto its new file, holds the folder's lock past A's ``lock_wait_s`` while A unpins it (a gate
    on B's copy). A's unpin gives up on the lock; its mark must go all the same, under the lock,
    by A's next store, not stay on B's file while A lives (d519811: A removed it from the old file
    without the lock, and forgot it: ``AssertionError: A's mark stayed on the record it unpinned``)."""
    first = tier_of(kind, folder, lock_wait_s=0.05)
    second = tier_of(kind, folder)
    # (B holds the folder's lock in the gate until A's unpin has given up waiting for it.)
    armed, unpinned, _ = during_carry_over(monkeypatch, lambda: first.unpin([PINNED]), wait_s=60)
    try:
        first.put([(PINNED, value_for(PINNED, VALUE))])
        assert first.pin([PINNED])[0][0] == "pinned"
        armed.set()
        second.put([(PINNED, value_for(PINNED, VALUE))])
        assert unpinned == [[VALUE]]
        assert first.stats().extra["pinned_bytes"] == 0
        other = key_of("tenant-b", "other")
        first.put([(other, value_for(other, VALUE))])  # A's next store holds the folder's lock
        assert marks_on(path_of(folder, PINNED)) == [], "A's mark stayed on the record it unpinned"
    finally:
        first.close()
        second.close()


def test_an_owners_lock_file_a_crash_left_half_made_is_swept(kind: str, folder: Path) -> None:
    """An engine killed between making its lock file (``<owner>.tmp``) and renaming it left it
    behind, unlocked: the next engine to open the folder removes it (d519811 kept it for good,
    ``AssertionError: a crashed owner's temp lock file stayed``). One a live owner holds (being
    made) stays."""
    owners = folder / OWNERS_FOLDER
    owners.mkdir(mode=0o700, parents=True)
    left = owners / f"{'ab' * 16}.tmp"
    left.touch(mode=0o600)
    held = owners / f"{'cd' * 16}.tmp"
    held.touch(mode=0o600)
    with held.open("rb") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        tier = tier_of(kind, folder)
        try:
            assert not left.exists(), "a crashed owner's temp lock file stayed"
            assert held.exists(), "the temp lock file of an owner being made was removed"
            tier.put([(PINNED, value_for(PINNED, VALUE))])
            assert tier.pin([PINNED])[0][0] == "pinned"
            assert len(marks_on(path_of(folder, PINNED))) == 1
        finally:
            tier.close()


def test_a_record_kept_for_another_engine_that_a_third_removed_stops_counting_off_the_quota(
    started: list[Worker], kind: str, folder: Path
) -> None:
    """w1 leaves w0's pinned tenant-a record in place for its quota evictions (it counts against
    the quota in w0, not in w1); then a third engine removes that record (``kvplug ctl clear``, a
    corrupt read), and w2 stores a tenant-a record w1 does not know of. While w0 lives, w1 must not
    go on taking the removed record's bytes off tenant-a's count in the folder: it would leave w2's
    record in place, tenant-a a record over its quota for as long as w1 stores and w0 runs
    (d519811: ``AssertionError: tenant-a holds more than its quota in the folder``)."""
    owner = start(started, kind, folder, "w0", budget=1 << 30)
    assert owner.ask("pin tenant-a system") == "pinned"
    other = start(started, kind, folder, "w1", budget=1 << 30)
    assert other.ask("put tenant-a 8") == "done"
    assert path_of(folder, key_of("tenant-a", "system")).exists()
    third = tier_of(kind, folder)
    try:
        third.remove([key_of("tenant-a", "system")])
    finally:
        third.close()
    late = start(started, kind, folder, "w2", budget=1 << 30)  # a record of tenant-a w1 does not know
    assert late.ask("put tenant-a 1") == "done"
    assert other.ask("put tenant-a 3") == "done"
    assert len(records(folder)) * FILE <= QUOTA, "tenant-a holds more than its quota in the folder"
    assert other.tenant_a_bytes(FOLDER_TENANT_BYTES) <= QUOTA
