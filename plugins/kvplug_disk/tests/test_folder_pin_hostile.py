"""Pins of folder tiers (``disk``, ``shm``) against what a hostile or odd host does: entries planted
in the owners' folder (``.kvplug-pins``), file systems without user extended attributes, and another
engine storing a pinned record again while this one unpins it or first finds it. Engines are tiers
in this process (two are two owners, their flocks as apart as two processes'); the helpers are in
:mod:`pinned_folders`."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pinned_folders import (
    BUDGET,
    FILE,
    PINNED,
    during_carry_over,
    fill,
    marks_on,
    path_of,
    records,
    refuse_user_attributes,
    tier_of,
)
from tenant_worker import VALUE

from kvplug import TierContext
from kvplug.testing import pins_context, value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier
from kvplug_disk.pin_marks import MARK_PREFIX, OWNERS_FOLDER


@pytest.fixture
def tiers(kind: str, folder: Path) -> Iterator[Callable[..., DiskTier]]:
    """Opens ``kind`` tiers of ``folder`` in this process (:func:`tier_of`), closed after the test."""
    opened: list[DiskTier] = []

    def open_tier(context: TierContext | None = None, **options: object) -> DiskTier:
        opened.append(tier := tier_of(kind, folder, context, **options))
        return tier

    yield open_tier
    for tier in opened:
        tier.close()


def test_without_user_attributes_a_pin_holds_in_its_own_process(
    tiers: Callable[..., DiskTier], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system without user extended attributes (tmpfs before Linux 6.6) refuses every
    mark (a mock: this host's file systems have them). The pin still holds in its own process,
    and the failure is counted."""
    refuse_user_attributes(monkeypatch)
    tier = tiers(max_bytes=BUDGET)
    tier.put([(PINNED, value_for(PINNED, VALUE))])
    assert tier.pin([PINNED])[0][0] == "pinned"
    fill(tier)
    assert path_of(folder, PINNED).exists()
    assert tier.stats().extra["pin_marks_failed"] >= 1


def test_a_linked_owners_folder_never_makes_the_tier_remove_files_outside_its_folder(
    tiers: Callable[..., DiskTier], folder: Path, tmp_path: Path
) -> None:
    """A hostile folder: ``.kvplug-pins`` is a link to another folder, which holds a file named
    like an owner, and a record carries a mark naming that owner. Evicting the record checks the
    owner: the tier must neither follow the link nor remove the file it leads to (4089e48: it
    did, ``AssertionError: the tier removed a file outside its folder``)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    owner = "ab" * 16
    (elsewhere / owner).write_text("not kvplug's")
    folder.mkdir(mode=0o700, exist_ok=True)
    (folder / OWNERS_FOLDER).symlink_to(elsewhere)
    tier = tiers(max_bytes=BUDGET)
    tier.put([(PINNED, value_for(PINNED, VALUE))])
    os.setxattr(path_of(folder, PINNED), MARK_PREFIX + owner, b"1")
    fill(tier)
    assert (elsewhere / owner).exists(), "the tier removed a file outside its folder"
    assert (folder / OWNERS_FOLDER).is_symlink()


@pytest.mark.parametrize("entry", ["link", "fifo", "folder", "many", "not-hex"])
def test_hostile_owner_entries_neither_hang_nor_keep_a_record_forever(
    tiers: Callable[..., DiskTier], folder: Path, tmp_path: Path, entry: str
) -> None:
    """A hostile folder: a record carries marks whose owners' lock files are a link (to a file
    outside the store), a FIFO or a folder, hundreds of marks of owners that never were, or a
    mark naming no owner at all. None is a live owner's lock (owners make regular files, locked
    before they get their names): the tier evicts the record for its budget, removes the marks,
    never hangs and never touches what a link leads to. 4089e48: a link kept the record in place
    for good (``AssertionError: a mark no live owner holds kept the record``)."""
    outside = tmp_path / "outside"
    outside.write_text("not kvplug's")
    owners = folder / OWNERS_FOLDER
    owners.mkdir(mode=0o700, parents=True)
    names = ["cd" * 16]
    if entry == "link":
        (owners / names[0]).symlink_to(outside)
    elif entry == "fifo":
        os.mkfifo(owners / names[0], 0o600)
    elif entry == "folder":
        (owners / names[0]).mkdir()
    elif entry == "many":
        names = [f"{i:032x}" for i in range(300)]
    else:
        names = ["../../outside"]
    tier = tiers(max_bytes=BUDGET)
    tier.put([(PINNED, value_for(PINNED, VALUE))])
    for name in names:
        try:
            os.setxattr(path_of(folder, PINNED), MARK_PREFIX + name, b"1")
        except OSError as exc:  # the file system's room for attributes is full: enough
            assert exc.errno in (errno.ENOSPC, errno.E2BIG), exc
            break
    fill(tier)
    assert not path_of(folder, PINNED).exists(), "a mark no live owner holds kept the record"
    assert len(records(folder)) * VALUE <= BUDGET
    assert outside.read_text() == "not kvplug's"


def test_an_unpin_while_another_engine_stores_the_record_again_leaves_no_mark(
    tiers: Callable[..., DiskTier], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A pins a record; engine B stores it again, and A unpins it between B copying the old
    file's marks onto its new file and renaming it into place (a gate on B's copy: two tiers in
    one process are two owners, their flocks as apart as two processes'). A's unpin must not
    leave A's mark on the new file, which would keep the record from every other engine for as
    long as A lives (4089e48: A removed its mark from the old file outside the folder's lock,
    ``AssertionError: A's unpin left its mark on the record B stored again``)."""
    first, second = tiers(), tiers()
    armed, unpinned, threads = during_carry_over(monkeypatch, lambda: first.unpin([PINNED]), wait_s=1.0)
    first.put([(PINNED, value_for(PINNED, VALUE))])
    assert first.pin([PINNED])[0][0] == "pinned"
    assert len(marks_on(path_of(folder, PINNED))) == 1
    armed.set()
    second.put([(PINNED, value_for(PINNED, VALUE))])
    for thread in threads:
        thread.join(60)
    assert unpinned == [[VALUE]]
    assert marks_on(path_of(folder, PINNED)) == [], "A's unpin left its mark on the record B stored again"


def test_a_record_a_lookup_finds_pinned_keeps_its_mark_when_another_engine_stores_it_again(
    tiers: Callable[..., DiskTier], folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engine A's pin book wants a record that engine B stored; B stores it again, and A's lookup
    first finds the record (pinning it as it enters A's order, and marking it) between B copying
    the old file's marks onto its new file and renaming it into place (a gate on B's copy). The
    new file must carry A's mark, or every other engine may evict what A takes as pinned
    (4089e48: A marked the old file outside the folder's lock, ``AssertionError: the record A
    pinned lost its mark``)."""
    context = pins_context()
    first, second = tiers(context), tiers()
    armed, found, threads = during_carry_over(monkeypatch, lambda: first.contains([PINNED]), wait_s=1.0)
    second.put([(PINNED, value_for(PINNED, VALUE))])
    context.tenancy.pins.add([PINNED])
    armed.set()
    second.put([(PINNED, value_for(PINNED, VALUE))])
    for thread in threads:
        thread.join(60)
    assert found == [[True]]
    assert first.stats().extra["pinned_bytes"] == FILE
    assert len(marks_on(path_of(folder, PINNED))) == 1, "the record A pinned lost its mark"


@pytest.mark.parametrize("entry", ["file", "no-attributes"])
def test_a_pin_that_cannot_be_marked_says_why(
    tiers: Callable[..., DiskTier],
    folder: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    entry: str,
) -> None:
    """A pin whose mark cannot be set holds in its own process only: the operator is told once,
    with the reason and the place, not just a count (4089e48: nothing was logged,
    ``AssertionError: no warning says why the pin holds in this process only``). ``file``: a
    ``.kvplug-pins`` that is a file; ``no-attributes``: a file system without user extended
    attributes (a mock: this host's file systems have them)."""
    if entry == "file":
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        (folder / OWNERS_FOLDER).write_text("")
    else:
        refuse_user_attributes(monkeypatch)
    tier = tiers()
    with caplog.at_level("WARNING"):
        for name in ("a", "b"):
            key = key_of("tenant-b", name)
            tier.put([(key, value_for(key, VALUE))])
            assert tier.pin([key])[0][0] == "pinned"
    warnings = [r.getMessage() for r in caplog.records if "this process only" in r.getMessage()]
    assert warnings, "no warning says why the pin holds in this process only"
    assert len(warnings) == 1, warnings
    reason = "Not a directory" if entry == "file" else "Operation not supported"
    assert reason in warnings[0] and str(folder) in warnings[0], warnings[0]
