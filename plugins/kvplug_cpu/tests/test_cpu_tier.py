"""Tier ``cpu`` against the storage contract, plus what is specific to it."""

from __future__ import annotations

import mmap
import subprocess
import sys

import pytest

from kvplug import MappedFile, is_mapped_file
from kvplug.testing import StorageTierContract, key_for, tier_context, value_for
from kvplug.testing.corrupt_races import check_remove_if_same_keeps_a_newer_value
from kvplug.testing.event_order import check_events_follow_state_changes
from kvplug_cpu import CPUTier


def make_cpu_tier(max_bytes: int | None = None, eviction: str = "lru", **events: object) -> CPUTier:
    options: dict[str, object] = {"eviction": eviction}
    if max_bytes is not None:
        options["max_bytes"] = max_bytes
    return CPUTier(CPUTier.Config(**options), tier_context(**events))


class TestCPUTierContract(StorageTierContract):
    @pytest.fixture
    def make_tier(self):
        return make_cpu_tier


class TestCPUTierS3FIFOContract(StorageTierContract):
    reads_to_keep = 2  # read once, a key does not outlive S3-FIFO's small queue

    @pytest.fixture
    def make_tier(self):
        return lambda max_bytes=None, **events: make_cpu_tier(max_bytes, "s3fifo", **events)


def test_a_key_evicted_and_stored_again_in_one_put_is_not_reported_evicted() -> None:
    events: list = []
    tier = make_cpu_tier(1000, emit=events.append)
    tier.put([("a", b"a" * 500), ("b", b"b" * 500)])
    tier.put([("c", b"c" * 500), ("a", b"A" * 500)])  # c evicts a, then a is stored again and evicts b
    assert tier.contains(["a", "b", "c"]) == [True, False, True]
    # What a router needs: a stored again (after c), b gone; a's eviction inside the put is not news.
    assert [(e.kind, e.keys) for e in events] == [("stored", ("a", "b")), ("stored", ("c", "a")), ("evicted", ("b",))]


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_accounting_is_exact_through_overwrite_remove_and_eviction(eviction: str) -> None:
    tier = make_cpu_tier(3_000, eviction)
    tier.put([(key_for("a"), b"a" * 1000), (key_for("b"), b"b" * 700)])
    assert tier.stats().bytes_used == 1700
    tier.put([(key_for("a"), b"A" * 300)])
    assert tier.stats().bytes_used == 1000
    tier.remove([key_for("b")])
    assert (tier.stats().bytes_used, tier.stats().items) == (300, 1)
    tier.put([(key_for(f"x{i}"), b"x" * 1000) for i in range(3)])
    stats = tier.stats()
    assert stats.bytes_used == 3000 and stats.items == 3 and stats.evictions == 1


def test_evictions_are_reported_as_events() -> None:
    events = []
    tier = make_cpu_tier(2_000, emit=events.append)
    tier.put([(key_for(f"e{i}"), value_for(f"e{i}", 1000)) for i in range(3)])
    assert [e.kind for e in events] == ["stored", "evicted"]
    assert events[0].keys == (key_for("e1"), key_for("e2"))  # e0 was pushed out by the same put: never held
    assert events[1].keys == (key_for("e0"),)


def test_closing_reports_what_the_tier_held_as_removed() -> None:
    events: list = []
    tier = make_cpu_tier(10_000, emit=events.append)
    tier.put([("a", b"a" * 10), ("b", b"b" * 10)])
    tier.remove(["b"])
    tier.close()
    tier.close()  # a second close reports nothing more
    assert [(e.kind, e.keys, e.tier) for e in events][-2:] == [("removed", ("b",), "cpu"), ("removed", ("a",), "cpu")]
    assert len(events) == 3


def test_the_tier_does_not_import_torch() -> None:
    code = "import sys, kvplug_cpu; kvplug_cpu.CPUTier; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pinning_is_off_without_cuda() -> None:
    assert make_cpu_tier().stats().extra["pinned"] is False
    with pytest.raises(RuntimeError, match="CUDA"):
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
        CPUTier(CPUTier.Config(pin_memory="always"), tier_context())


def test_a_view_of_a_mapped_file_is_copied_and_other_buffers_are_kept(tmp_path) -> None:
    """A value that is a view of a shared file's mapping (tier shm's hits, promoted here) is
    copied: kept, it would hold the file's pages after the file is evicted. Other buffers
    are kept as they are (frames of the engine's pool are not copied again)."""
    path = tmp_path / "record"
    path.write_bytes(b"r" * 8192)
    with open(path, "rb") as file:
        mapping = MappedFile(file.fileno(), 8192, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    mapped_view = memoryview(mapping)[100:4100].toreadonly()
    kept = bytearray(b"k" * 4000)
    tier = make_cpu_tier()
    tier.put([(key_for("mapped"), mapped_view), (key_for("kept"), kept)])
    held_mapped, held_kept = tier.get([key_for("mapped"), key_for("kept")])
    assert held_mapped == b"r" * 4000 and not is_mapped_file(held_mapped)
    assert isinstance(held_kept, memoryview) and held_kept.obj is kept  # not copied
    del mapped_view
    mapping.close()  # possible only when no view of it is left: the tier holds none
    assert tier.get([key_for("mapped")])[0] == b"r" * 4000


def test_remove_if_same_keeps_a_value_stored_since_the_read() -> None:
    """A load's removal of a value it found unusable keeps one put since (a promotion)."""
    tier = make_cpu_tier()
    check_remove_if_same_keeps_a_newer_value(tier, tier)
    assert tier.stats().bytes_used == 0 and tier.stats().items == 0


def test_events_arrive_in_the_order_of_the_changes() -> None:
    """A racing put evicts a chunk whose ``stored`` another thread is still delivering: the
    ``evicted`` must not overtake it (it used to: each thread sent its own events)."""
    check_events_follow_state_changes(lambda max_bytes, listener: make_cpu_tier(max_bytes, emit=listener))
