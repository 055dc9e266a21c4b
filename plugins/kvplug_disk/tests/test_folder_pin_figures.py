"""An engine's figure in its lock file (its pinned bytes, :mod:`kvplug_disk.pin_owners`) follows
what it pins however its pins end: a pinned record found corrupt and removed, or removed by
another engine, takes its bytes off the figure the other engines sum, so the folder's pins are
not refused for good. The helpers are :mod:`test_folder_pins`'s; two tiers of one folder in
this process are two owners, their lock files as apart as two processes'."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from tenant_worker import VALUE
from test_folder_pins import FILE, path_of, tier_of

from kvplug.testing import value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier

PINNED = key_of("tenant-b", "system")
OTHER = key_of("tenant-b", "other")


def corrupt(folder: Path, first: DiskTier, second: DiskTier) -> None:
    """The pinned record's value is damaged on disk (a bad block): the engine pinning it reads it."""
    path = path_of(folder, PINNED)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def removed_by_another(folder: Path, first: DiskTier, second: DiskTier) -> None:
    """Another engine removes the record (``kvplug ctl clear`` there)."""
    second.remove([PINNED])


@pytest.mark.parametrize("lose", [corrupt, removed_by_another])
def test_a_pinned_record_that_leaves_the_folder_leaves_its_engines_figure(
    kind: str, folder: Path, lose: Callable[[Path, DiskTier, DiskTier], None]
) -> None:
    """Engine A pins a record, which then leaves the folder without an unpin (found corrupt as A
    reads it, or removed by engine B); A pins nothing now, so B may pin a record of its own
    within folder_pin_max_bytes (room for one). aff7177 kept A's figure at the record's bytes,
    until A's next pin or unpin: every other engine's pins refused meanwhile
    (``AssertionError: A's figure still counts a record it lost; assert 1064 == 0``)."""
    options = {"max_bytes": 1 << 20, "folder_pin_max_bytes": FILE + FILE // 2}
    first, second = tier_of(kind, folder, **options), tier_of(kind, folder, **options)
    try:
        first.put([(PINNED, value_for(PINNED, VALUE))])
        second.put([(OTHER, value_for(OTHER, VALUE))])
        assert first.pin([PINNED])[0][0] == "pinned"
        assert second.stats().extra["folder_pinned_bytes"] == FILE
        lose(folder, first, second)
        assert first.get([PINNED]) == [None]
        assert first.stats().extra["pinned_bytes"] == 0
        assert second.stats().extra["folder_pinned_bytes"] == 0, "A's figure still counts a record it lost"
        assert second.pin([OTHER])[0][0] == "pinned"
    finally:
        first.close()
        second.close()
