"""Tier ``shm`` on a tmpfs that is full before ``max_bytes`` binds: a write evicts only as
many records as it needs, only evictions that give memory back count, and values
promoted into tier ``cpu`` never hold the folder's memory. On a real 4 MiB tmpfs
(``small_tmpfs``), shared by two tiers as two engines share one."""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from kvplug import is_mapped_file, key_digest
from kvplug.testing import key_for, tier_context, value_for
from kvplug_cpu import CPUTier
from kvplug_disk import ShmTier, room
from kvplug_disk.mounts import huge_pages_of

#: A record of this value fills 12 pages of 4 KiB (with its 64-byte header).
VALUE_BYTES = 48_000
RECORD_PAGES = 12


def open_shm(folder: Path) -> ShmTier:
    # A budget the tmpfs reaches first: what runs out is the file system's memory.
    return ShmTier(ShmTier.Config(path=folder, max_bytes="64MiB"), tier_context())


def free_pages(folder: Path) -> int:
    found = os.statvfs(folder)
    return found.f_bavail * found.f_frsize // 4096


def fill(tier: ShmTier, folder: Path, engine: str) -> list[str]:
    """Store records until the next would not fit; their keys."""
    keys = []
    while free_pages(folder) >= RECORD_PAGES:
        key = key_for(f"{engine}-{len(keys)}")
        tier.put([(key, value_for(key, VALUE_BYTES))])
        keys.append(key)
    assert tier.stats().evictions == 0 and all(tier.contains(keys))
    return keys


@pytest.fixture
def folder(small_tmpfs: Path) -> Path:
    if huge_pages_of(small_tmpfs) != "never":
        pytest.skip("this host backs every tmpfs with huge pages (shmem_enabled: force)")
    return small_tmpfs / "kv"


@pytest.fixture
def tiers(folder: Path) -> Iterator[ExitStack]:
    with ExitStack() as opened:
        yield opened


def test_a_write_to_a_full_tmpfs_evicts_what_it_needs_and_promoted_values_hold_no_pages(
    folder: Path, tiers: ExitStack
) -> None:
    """Engine B fills the tmpfs; engine A reads all of it and promotes it into its cpu tier,
    then stores: each write evicts one of B's records (what it needs), whose memory comes
    back, rather than every record of B for nothing."""
    b = tiers.enter_context(open_shm(folder))
    b_keys = fill(b, folder, "b")
    assert len(b_keys) >= 60
    a = tiers.enter_context(open_shm(folder))
    cpu = tiers.enter_context(CPUTier(CPUTier.Config(max_bytes="1GiB"), tier_context()))
    found = a.get(b_keys)
    assert all(value is not None and is_mapped_file(value) for value in found)
    cpu.put([(key, value) for key, value in zip(b_keys, found) if value is not None])  # as the chain promotes
    del found
    assert not any(is_mapped_file(value) for value in cpu.get(b_keys) if value is not None)

    a_keys = [key_for(f"a-{i}") for i in range(3)]
    for key in a_keys:
        a.put([(key, value_for(key, VALUE_BYTES))])
    assert a.contains(a_keys) == [True, True, True]
    extra = a.stats().extra
    # B's records are A's size: one eviction makes room for one write, and gives its memory back.
    assert (a.stats().evictions, extra["enospc_evictions"], extra["enospc_in_vain"]) == (3, 3, 0)
    assert sum(b.contains(b_keys)) == len(b_keys) - 3
    assert all(value == value_for(key, VALUE_BYTES) for key, value in zip(b_keys, cpu.get(b_keys)))


def test_an_eviction_that_frees_nothing_ends_the_write_and_later_writes_evict_nothing(
    folder: Path, tiers: ExitStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While every record's pages are still mapped (as by other processes' views), evicting
    them gives no memory back: the first eviction that frees nothing ends the write (dropped,
    counted), and writes after it drop without evicting until memory comes back."""
    monkeypatch.setattr(room, "IN_VAIN_HOLD_OFF_S", 3600.0)  # no clock in this test: held off until memory is freed
    b = tiers.enter_context(open_shm(folder))
    b_keys = fill(b, folder, "b")
    mappings = []
    for key in b_keys:
        digest = key_digest(key).hex()
        with open(folder / digest[:2] / f"{digest}.kvr", "rb") as record:
            mappings.append(mmap.mmap(record.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ))
    a = tiers.enter_context(open_shm(folder))
    try:
        a_keys = [key_for(f"a-{i}") for i in range(5)]
        for key in a_keys:
            a.put([(key, value_for(key, VALUE_BYTES))])
        assert a.contains(a_keys) == [False] * 5
        assert sum(b.contains(b_keys)) == len(b_keys) - 1  # not one record of B per write, nor all of them
        stats = a.stats()
        assert (stats.evictions, stats.extra["enospc_in_vain"], stats.extra["dropped_puts"]) == (1, 1, 5)
    finally:
        for mapping in mappings:
            mapping.close()  # the evicted record's memory comes back

    later = [key_for(f"a-later-{i}") for i in range(2)]
    for key in later:
        a.put([(key, value_for(key, VALUE_BYTES))])
    assert a.contains(later) == [True, True]
    stats = a.stats()
    # The first fits in the memory the in-vain eviction gave back; the second evicts one record.
    assert (stats.evictions, stats.extra["enospc_in_vain"]) == (2, 1)
    assert sum(b.contains(b_keys)) == len(b_keys) - 2
