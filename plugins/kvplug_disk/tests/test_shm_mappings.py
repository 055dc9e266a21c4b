"""Tier ``shm`` keeps the mappings of the records it read (kvplug_disk.mappings): a
record read again is a view of the same mapping; a record rewritten, evicted or removed
by another process is never served from a kept mapping, and its mapping is let go."""

from __future__ import annotations

import mmap
import time
from pathlib import Path

from test_shm_tier import make_shm_tier

from kvplug import key_digest
from kvplug.testing import key_for, value_for
from kvplug_disk.mappings import SWEEP_INTERVAL_S, MappedRecords


def mapped_files(folder: Path) -> list[str]:
    """The files of ``folder`` this process has mapped now (from the kernel's own list)."""
    with open("/proc/self/maps", encoding="utf-8") as maps:
        return [line.split(maxsplit=5)[5].strip() for line in maps if str(folder) in line]


def record_path(folder: Path, name: str) -> Path:
    digest = key_digest(key_for(name)).hex()
    return folder / digest[:2] / f"{digest}.kvr"


def test_a_record_read_again_is_a_view_of_the_mapping_kept_from_the_first_read(shm_dir: Path) -> None:
    tier = make_shm_tier(shm_dir)
    try:
        tier.put([(key_for("a"), value_for("a", 100_000))])
        (first,) = tier.get([key_for("a")])
        (again,) = tier.get([key_for("a")])
        assert isinstance(first, memoryview) and isinstance(first.obj, mmap.mmap)
        assert isinstance(again, memoryview) and again.obj is first.obj
        assert again == value_for("a", 100_000)
        extra = tier.stats().extra
        assert (extra["mapping_reuses"], extra["mapped_records"]) == (1, 1)
        assert extra["mapped_bytes"] == len(first.obj)
    finally:
        tier.close()


def test_a_record_another_process_wrote_again_is_mapped_anew(shm_dir: Path) -> None:
    reader, writer = make_shm_tier(shm_dir), make_shm_tier(shm_dir)
    try:
        writer.put([(key_for("a"), value_for("old", 50_000))])
        assert reader.get([key_for("a")]) == [value_for("old", 50_000)]
        writer.put([(key_for("a"), value_for("new", 50_000))])  # same size, a new file renamed over
        (value,) = reader.get([key_for("a")])
        assert value == value_for("new", 50_000)
        assert reader.stats().extra["mapping_reuses"] == 0
    finally:
        reader.close()
        writer.close()


def test_a_record_another_process_removed_is_a_miss_and_its_mapping_goes_within_a_sweep_while_idle(
    shm_dir: Path,
) -> None:
    reader, other = make_shm_tier(shm_dir), make_shm_tier(shm_dir)
    try:
        reader.put([(key_for(name), value_for(name, 50_000)) for name in ("gone", "kept")])
        assert None not in reader.get([key_for("gone"), key_for("kept")])
        gone = record_path(shm_dir, "gone")
        assert str(gone) in mapped_files(shm_dir)
        other.remove([key_for("gone")])
        assert not gone.exists()
        deadline = time.monotonic() + 10 * SWEEP_INTERVAL_S  # the reader idles meanwhile
        while any(str(gone) in f for f in mapped_files(shm_dir)) and time.monotonic() < deadline:
            time.sleep(SWEEP_INTERVAL_S / 10)
        assert [f for f in mapped_files(shm_dir) if str(gone) in f] == []  # its pages are free now
        assert reader.get([key_for("gone")]) == [None]
        assert reader.get([key_for("kept")]) == [value_for("kept", 50_000)]
        extra = reader.stats().extra
        assert (extra["mappings_swept"], extra["mapped_records"]) == (1, 1)
    finally:
        reader.close()
        other.close()


def test_a_record_this_process_evicts_lets_its_mapping_go_at_once(shm_dir: Path) -> None:
    tier = make_shm_tier(shm_dir, max_bytes=250_000)
    try:
        tier.put([(key_for("first"), value_for("first", 100_000))])
        assert tier.get([key_for("first")]) == [value_for("first", 100_000)]
        tier.put([(key_for(f"next{i}"), value_for(f"next{i}", 100_000)) for i in range(2)])  # evicts "first"
        assert not record_path(shm_dir, "first").exists()
        assert mapped_files(shm_dir) == [] and tier.stats().extra["mapped_records"] == 0
    finally:
        tier.close()


def test_kept_mappings_stay_within_keep_mapped_bytes_and_none_are_kept_at_zero(shm_dir: Path) -> None:
    names = [f"k{i}" for i in range(6)]
    for kept, expected in ((250_000, 2), (0, 0)):
        folder = shm_dir / str(kept)
        tier = make_shm_tier(folder, keep_mapped_bytes=kept)
        try:
            tier.put([(key_for(name), value_for(name, 100_000)) for name in names])
            values = tier.get([key_for(name) for name in names])
            assert values == [value_for(name, 100_000) for name in names]
            del values
            extra = tier.stats().extra
            assert (extra["mapped_records"], extra["mapped_bytes"] <= kept) == (expected, True)
            assert len(mapped_files(folder)) == expected  # the others were unmapped with their last view
            assert tier.get([key_for(names[-1])]) == [value_for(names[-1], 100_000)]
            assert tier.stats().extra["mapping_reuses"] == (1 if expected else 0)
        finally:
            tier.close()


def test_a_mapping_is_marked_verified_only_through_a_view_of_it(shm_dir: Path) -> None:
    """The checksum verified over one mapping says nothing of another mapping of the same name."""
    path = shm_dir / "f"
    path.write_bytes(b"x" * 4096)
    kept = MappedRecords(max_bytes=1 << 20, stat=lambda digest: path.stat(), max_count=4)
    with open(path, "rb") as file:
        info = path.stat()
        first, other = (mmap.mmap(file.fileno(), 4096, prot=mmap.PROT_READ) for _ in range(2))
    kept.keep("d", info, first)
    kept.mark_verified("d", memoryview(other))
    assert not kept.verified("d", memoryview(first))
    kept.mark_verified("d", memoryview(first))
    assert kept.verified("d", memoryview(first)) and not kept.verified("d", memoryview(other))
    assert kept.reuse("d", info) is first
    kept.close()
    assert kept.describe()["mapped_records"] == 0
