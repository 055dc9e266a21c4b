"""An engine's figure in its lock file (its pinned bytes, :mod:`kvplug_disk.pin_owners`) follows
what it pins however its pins change: a pinned record found corrupt and removed, or removed by
another engine, takes its bytes off the figure the other engines sum, so the folder's pins are
not refused for good; a pin or unpin made, or a record the pin book wants found, while another
process holds the folder's lock is in the figure at once. The helpers are in
:mod:`pinned_folders`; two tiers of one folder in this process are two owners, their lock files
as apart as two processes'."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pinned_folders import FILE, path_of, tier_of
from tenant_worker import VALUE

from kvplug import TierContext
from kvplug.testing import pins_context, value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier

PINNED = key_of("tenant-b", "system")
OTHER = key_of("tenant-b", "other")
FOUND = key_of("tenant-b", "found")


@dataclass
class Engines:
    """Two engines of one folder, whose pins leave room for one record (``folder_pin_max_bytes``):
    A (``first``, its tier context ``context``) has stored ``PINNED``, B (``second``) ``OTHER``.
    A waits 0.05 s for the folder's lock, so a test holding it (as B) sees A give up at once."""

    first: DiskTier
    second: DiskTier
    context: TierContext


@pytest.fixture
def engines(kind: str, folder: Path) -> Iterator[Engines]:
    options = {"max_bytes": 1 << 20, "folder_pin_max_bytes": FILE + FILE // 2}
    context = pins_context()
    first = tier_of(kind, folder, context, lock_wait_s=0.05, **options)
    second = tier_of(kind, folder, **options)
    try:
        first.put([(PINNED, value_for(PINNED, VALUE))])
        second.put([(OTHER, value_for(OTHER, VALUE))])
        yield Engines(first, second, context)
    finally:
        first.close()
        second.close()


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
    engines: Engines, folder: Path, lose: Callable[[Path, DiskTier, DiskTier], None]
) -> None:
    """Engine A pins a record, which then leaves the folder without an unpin (found corrupt as A
    reads it, or removed by engine B); A pins nothing now, so B may pin a record of its own
    within folder_pin_max_bytes (room for one). aff7177 kept A's figure at the record's bytes,
    until A's next pin or unpin: every other engine's pins refused meanwhile
    (``AssertionError: A's figure still counts a record it lost; assert 1064 == 0``)."""
    first, second = engines.first, engines.second
    assert first.pin([PINNED])[0][0] == "pinned"
    assert second.stats().extra["folder_pinned_bytes"] == FILE
    lose(folder, first, second)
    assert first.get([PINNED]) == [None]
    assert first.stats().extra["pinned_bytes"] == 0
    assert second.stats().extra["folder_pinned_bytes"] == 0, "A's figure still counts a record it lost"
    assert second.pin([OTHER])[0][0] == "pinned"


def test_an_unpin_that_cannot_take_the_folders_lock_takes_its_bytes_off_the_figure(engines: Engines) -> None:
    """Engine A unpins its record while engine B holds the folder's lock past A's lock_wait_s (a
    process paused holding it). The unpin holds in A all the same, and a figure falling passes no
    bound, so A's must fall with it, not wait for A's next pin, unpin or store (B's pin refused
    meanwhile). aff7177 kept it (``AssertionError: assert 1064 == 0``)."""
    first, second = engines.first, engines.second
    assert first.pin([PINNED])[0][0] == "pinned"
    with second._backend._ledger.locked(timeout_s=60, then="-"):  # type: ignore[attr-defined]
        assert first.unpin([PINNED]) == [VALUE]
    assert first.stats().extra["pinned_bytes"] == 0
    assert second.stats().extra["folder_pinned_bytes"] == 0
    assert second.pin([OTHER])[0][0] == "pinned"


def test_a_pin_made_without_the_folders_lock_is_in_the_figure_at_once(engines: Engines) -> None:
    """Engine A pins a record while engine B holds the folder's lock past A's lock_wait_s: the pin
    holds in A (decided against the figures as last written), and its bytes must be in A's figure
    at once, or every other engine's pins are decided without them until A's next pin, unpin or
    store, all passing folder_pin_max_bytes (room for one record here). A has pinned before (its
    lock file, made under the folder's lock only, is there). aff7177 wrote nothing
    (``AssertionError: assert 0 == 1064``)."""
    first, second = engines.first, engines.second
    assert first.pin([PINNED])[0][0] == "pinned"
    assert first.unpin([PINNED]) == [VALUE]
    with second._backend._ledger.locked(timeout_s=60, then="-"):  # type: ignore[attr-defined]
        assert first.pin([PINNED])[0][0] == "pinned"
    assert second.stats().extra["folder_pinned_bytes"] == FILE
    assert second.pin([OTHER])[0][0] == "refused"


def test_a_wanted_record_a_lookup_finds_without_the_folders_lock_is_in_the_figure_at_once(
    engines: Engines,
) -> None:
    """Engine A's pin book wants a record engine B stored; A's lookup finds it (pinning it as it
    enters A's order) while B holds the folder's lock past A's lock_wait_s, so A cannot mark it
    yet. The pin holds in A, and its bytes must be in A's figure at once, as a pin's are, or B's
    pins are decided without them (room for one record here). A has pinned before (its lock file
    is there). ee9bb23 wrote the figure only with the mark, under the folder's lock: nothing until
    A's next pin, unpin or store (``AssertionError: A's figure misses the record its lookup
    pinned; assert 0 == 1064``)."""
    first, second = engines.first, engines.second
    assert first.pin([PINNED])[0][0] == "pinned"
    assert first.unpin([PINNED]) == [VALUE]
    second.put([(FOUND, value_for(FOUND, VALUE))])
    engines.context.tenancy.pins.add([FOUND])
    with second._backend._ledger.locked(timeout_s=60, then="-"):  # type: ignore[attr-defined]
        assert first.contains([FOUND]) == [True]
    assert first.stats().extra["pinned_bytes"] == FILE
    assert second.stats().extra["folder_pinned_bytes"] == FILE, "A's figure misses the record its lookup pinned"
    assert second.pin([OTHER])[0][0] == "refused"
