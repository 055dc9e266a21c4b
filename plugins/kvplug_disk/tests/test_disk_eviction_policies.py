"""Tier ``disk``'s eviction policies (``eviction: lru|s3fifo``) on a real folder: the storage
contract with ``s3fifo``, the folder's byte budget under random puts and reads with either
policy, a working set read twice that outlives a scan of one-off keys with ``s3fifo`` (and
not with ``lru``), and the start-up order (the oldest file first) with either policy.

The order is each process's own and the budget the folder's: test_disk_processes.py
covers processes sharing a folder."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug import RECORD_HEADER_SIZE
from kvplug.testing import StorageTierContract, key_for, tier_context, value_for
from kvplug_disk import DiskTier

POLICIES = ["lru", "s3fifo"]


def make_disk_tier(path: Path, max_bytes: int | None, eviction: str) -> DiskTier:
    options = {} if max_bytes is None else {"max_bytes": max_bytes}
    return DiskTier(DiskTier.Config(path=path, eviction=eviction, fsync=False, **options), tier_context())


def folder_value_bytes(root: Path) -> int:
    """The value bytes of every record file in the folder (what ``max_bytes`` bounds)."""
    return sum(path.stat().st_size - RECORD_HEADER_SIZE for path in root.glob("*/*.kvr"))


class TestDiskTierS3FIFOContract(StorageTierContract):
    large_value_bytes = 4 * 1024 * 1024
    reads_to_keep = 2  # read once, a key does not outlive S3-FIFO's small queue

    @pytest.fixture
    def make_tier(self, tmp_path: Path):
        return lambda max_bytes=None: make_disk_tier(tmp_path / "cache", max_bytes, "s3fifo")


# (operation, key number, value size in KiB): puts and reads of a few keys, so they repeat.
OPS = st.lists(
    st.tuples(st.sampled_from(["put", "get", "get"]), st.integers(0, 15), st.integers(1, 4)),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None)
@given(ops=OPS, eviction=st.sampled_from(POLICIES), budget_kib=st.integers(4, 12))
def test_the_folder_budget_holds_after_every_put(tmp_path_factory, ops, eviction, budget_kib) -> None:
    root = tmp_path_factory.mktemp("budget")
    budget = budget_kib * 1024
    tier = make_disk_tier(root, budget, eviction)
    stored: dict[str, bytes] = {}
    try:
        for op, number, kib in ops:
            key = key_for(f"k{number}")
            if op == "put":
                value = value_for(f"k{number}/{kib}", kib * 1024)
                tier.put([(key, value)])
                stored[key] = value
                on_disk = folder_value_bytes(root)
                stats = tier.stats()
                assert on_disk <= budget
                assert stats.bytes_used <= budget
                assert stats.extra["folder_bytes"] == on_disk  # the folder's ledger is exact
                assert tier.contains([key]) == [True]  # the record just put is never its own victim
            else:
                found = tier.get([key])[0]
                assert found is None or bytes(found) == stored[key]
        assert tier.stats().extra["eviction"] == eviction
    finally:
        tier.close()


HOT = 6  # the working set: 6 records of 1 KiB, in a budget of 16
SCAN = 48  # one-off records: three times the budget


def hot_records_left_after_a_scan(root: Path, eviction: str) -> list[bool]:
    """Store a working set and read each of its records twice, then store one-off records
    three times the budget, none read: which records of the working set are left."""
    tier = make_disk_tier(root, 16 * 1024, eviction)
    hot = [key_for(f"hot{i}") for i in range(HOT)]
    try:
        for i, key in enumerate(hot):
            tier.put([(key, value_for(f"hot{i}", 1024))])
        for _ in range(2):
            assert all(value is not None for value in tier.get(hot))
        for i in range(SCAN):
            tier.put([(key_for(f"scan{i}"), value_for(f"scan{i}", 1024))])
            assert folder_value_bytes(root) <= 16 * 1024
        assert tier.stats().evictions >= SCAN + HOT - 16
        left = tier.contains(hot)
        for i, (key, present) in enumerate(zip(hot, left)):
            if present:
                assert bytes(tier.get([key])[0]) == value_for(f"hot{i}", 1024)
        return left
    finally:
        tier.close()


def test_with_s3fifo_a_working_set_read_twice_outlives_a_scan_of_one_off_records(tmp_path: Path) -> None:
    assert hot_records_left_after_a_scan(tmp_path, "s3fifo") == [True] * HOT


def test_with_lru_the_same_scan_evicts_the_working_set(tmp_path: Path) -> None:
    assert hot_records_left_after_a_scan(tmp_path, "lru") == [False] * HOT


@pytest.mark.parametrize("eviction", POLICIES)
def test_records_found_at_start_leave_first_oldest_first(tmp_path: Path, eviction: str) -> None:
    """Every record a restart lists enters cold, in file mtime order (writes and hits set it):
    the oldest leaves first, and all of them before what the new process writes."""
    first = make_disk_tier(tmp_path, 1 << 20, eviction)
    for i in range(4):
        first.put([(key_for(f"s{i}"), value_for(f"s{i}", 1000))])
    assert first.get([key_for("s0")])[0] is not None  # s0's file becomes the newest
    first.close()
    second = make_disk_tier(tmp_path, 3_000, eviction)  # room for three: s1, the oldest file, goes
    assert second.contains([key_for(f"s{i}") for i in range(4)]) == [True, False, True, True]
    second.put([(key_for("n0"), value_for("n0", 1000))])  # then s2
    second.put([(key_for("n1"), value_for("n1", 1000))])  # then s3
    keys = [key_for(name) for name in ("s0", "s2", "s3", "n0", "n1")]
    assert second.contains(keys) == [True, False, False, True, True]
    second.close()
