"""Tier ``disk`` against the storage contract, plus what is specific to it."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvplug import RECORD_HEADER_SIZE
from kvplug.testing import StorageTierContract, key_for, tier_context, value_for
from kvplug_disk import DiskTier, verify_folder
from kvplug_disk.folder_scan import HOST_TAG
from kvplug_disk.ledger import LEDGER_NAME
from kvplug_disk.location import STORE_MARKER


def make_disk_tier(path: Path, max_bytes: int | None = None, **options: object) -> DiskTier:
    if max_bytes is not None:
        options["max_bytes"] = max_bytes
    events = {"emit": options.pop("emit")} if "emit" in options else {}
    return DiskTier(DiskTier.Config(path=path, **options), tier_context(**events))


def record_path(root: Path, key: str) -> Path:
    """Where the documented layout puts ``key``'s record: ``<ab>/<sha256 hex>.kvr``."""
    digest = hashlib.sha256(key.encode()).hexdigest()
    return root / digest[:2] / f"{digest}.kvr"


class TestDiskTierContract(StorageTierContract):
    large_value_bytes = 32 * 1024 * 1024

    @pytest.fixture
    def make_tier(self, tmp_path: Path):
        return lambda max_bytes=None: make_disk_tier(tmp_path / "cache", max_bytes)


class TestInlineDiskTierContract(StorageTierContract):
    large_value_bytes = 8 * 1024 * 1024
    concurrency_seconds = 1.0

    @pytest.fixture
    def make_tier(self, tmp_path: Path):
        return lambda max_bytes=None: make_disk_tier(tmp_path / "cache", max_bytes)


# --- files and accounting ---------------------------------------------------------------


def test_one_record_file_per_key_named_by_digest_and_nothing_else(tmp_path: Path) -> None:
    tier = make_disk_tier(tmp_path)
    key = key_for("file")
    tier.put([(key, value_for("file", 5000))])
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert files == [
        tmp_path / STORE_MARKER,
        tmp_path / LEDGER_NAME,
        record_path(tmp_path, key),
    ]  # what says the folder is a store, the folder's shared byte total, and the record
    assert files[2].stat().st_size == 5000 + 64
    stats = tier.stats()
    assert (stats.bytes_used, stats.items, stats.extra["file_bytes"]) == (5000, 1, 5064)
    tier.close()


def test_accounting_is_exact_through_overwrite_remove_and_eviction(tmp_path: Path) -> None:
    tier = make_disk_tier(tmp_path, 3_000)
    tier.put([(key_for("a"), b"a" * 1000), (key_for("b"), b"b" * 700)])
    assert tier.stats().bytes_used == 1700
    tier.put([(key_for("a"), b"A" * 300)])
    assert tier.stats().bytes_used == 1000
    tier.remove([key_for("b")])
    assert (tier.stats().bytes_used, tier.stats().items) == (300, 1)
    tier.put([(key_for(f"x{i}"), b"x" * 1000) for i in range(3)])
    stats = tier.stats()
    assert stats.bytes_used == 3000 and stats.items == 3 and stats.evictions == 1
    assert not record_path(tmp_path, key_for("a")).exists()
    tier.close()


def test_evictions_and_removals_are_reported_as_events(tmp_path: Path) -> None:
    events: list = []
    tier = make_disk_tier(tmp_path, 2_000, emit=events.append)
    tier.put([(key_for(f"e{i}"), value_for(f"e{i}", 1000)) for i in range(3)])
    tier.remove([key_for("e2"), key_for("never")])
    assert [(e.kind, e.keys, e.tier) for e in events] == [
        ("stored", (key_for("e0"), key_for("e1"), key_for("e2")), "disk"),  # before what the put evicts
        ("evicted", (key_for("e0"),), "disk"),
        ("removed", (key_for("e2"),), "disk"),
    ]
    tier.close()


def test_a_record_evicted_and_written_again_in_one_put_is_held_not_reported_evicted(tmp_path: Path) -> None:
    events: list = []
    tier = make_disk_tier(tmp_path, 2_000, emit=events.append, queue={"mode": "sync"})
    tier.put([(key_for("a"), value_for("a", 1000)), (key_for("b"), value_for("b", 1000))])
    # Writing c evicts a (least recently used); then a is written again, evicting b.
    tier.put([(key_for("c"), value_for("c", 1000)), (key_for("a"), value_for("a2", 1000))])
    assert tier.contains([key_for("a"), key_for("b"), key_for("c")]) == [True, False, True]
    assert [(e.kind, e.keys) for e in events] == [
        ("stored", (key_for("a"), key_for("b"))),
        ("stored", (key_for("c"), key_for("a"))),
        ("evicted", (key_for("b"),)),
    ]
    stats = tier.stats()
    assert (stats.items, stats.bytes_used, stats.evictions) == (2, 2000, 1)
    tier.close()


# --- restart and LRU order ---------------------------------------------------------------


def test_a_new_tier_finds_what_the_last_one_stored_and_keeps_its_lru_order(tmp_path: Path) -> None:
    first = make_disk_tier(tmp_path, 5_000)
    for i in range(5):
        first.put([(key_for(f"r{i}"), value_for(f"r{i}", 1000))])
    first.flush()
    assert first.get([key_for("r0")])[0] is not None  # r0 becomes the most recently used
    first.close()
    second = make_disk_tier(tmp_path, 5_000)
    assert (second.stats().items, second.stats().bytes_used) == (5, 5000)
    second.put([(key_for("r5"), value_for("r5", 1000))])
    second.flush()
    assert second.contains([key_for(f"r{i}") for i in range(6)]) == [True, False, True, True, True, True]
    assert bytes(second.get([key_for("r3")])[0]) == value_for("r3", 1000)
    second.close()


def test_reading_a_record_for_inspection_is_not_a_use_of_it(tmp_path: Path) -> None:
    """``kvplug store verify/ls/gc`` and ``kvplug explain`` read through read_record: the
    file's mtime (the order a restart rebuilds) and the eviction order stay as they were."""
    tier = make_disk_tier(tmp_path, 2_000)
    tier.put([(key_for("p0"), value_for("p0", 1000))])
    tier.put([(key_for("p1"), value_for("p1", 1000))])
    path = record_path(tmp_path, key_for("p0"))
    old = time.time_ns() - 3600 * 10**9
    os.utime(path, ns=(old, old))
    data = tier.read_record(path.name.removesuffix(".kvr"))
    assert data is not None and bytes(data)[RECORD_HEADER_SIZE:] == value_for("p0", 1000)
    assert path.stat().st_mtime_ns == old
    tier.put([(key_for("p2"), value_for("p2", 1000))])  # evicts the least recently used: p0
    assert tier.contains([key_for(f"p{i}") for i in range(3)]) == [False, True, True]
    tier.close()


@pytest.mark.parametrize("write_threads", [1, 4])
def test_records_of_one_put_written_at_once_keep_the_put_order(tmp_path: Path, write_threads: int) -> None:
    """A batch's records are written on several threads, finishing in any order; the LRU order a
    restart rebuilds (from mtimes) is still the order they were put in."""
    first = make_disk_tier(tmp_path, write_threads=write_threads)
    sizes = [300_000, 1000, 200_000, 10, 100_000, 1000, 50_000, 1]  # big ones first: they finish last
    first.put([(key_for(f"b{i}"), value_for(f"b{i}", size)) for i, size in enumerate(sizes)])
    assert first.stats().items == len(sizes)
    first.close()
    names = [record_path(tmp_path, key_for(f"b{i}")) for i in range(len(sizes))]
    stamps = [path.stat().st_mtime_ns for path in names]
    assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
    second = make_disk_tier(tmp_path, sum(sizes[4:]))  # room for the last four only
    assert second.contains([key_for(f"b{i}") for i in range(len(sizes))]) == [False] * 4 + [True] * 4
    kept = second.get([key_for(f"b{i}") for i in range(4, len(sizes))])
    assert [bytes(v) for v in kept if v is not None] == [value_for(f"b{i}", sizes[i]) for i in range(4, len(sizes))]
    second.close()


def test_write_threads_is_at_least_one(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="write_threads"):
        make_disk_tier(tmp_path, write_threads=0)


def test_a_smaller_budget_at_start_evicts_the_oldest(tmp_path: Path) -> None:
    first = make_disk_tier(tmp_path)
    for i in range(4):
        first.put([(key_for(f"s{i}"), value_for(f"s{i}", 1000))])
    first.close()
    second = make_disk_tier(tmp_path, 2_500)
    assert second.contains([key_for(f"s{i}") for i in range(4)]) == [False, False, True, True]
    assert second.stats().bytes_used == 2000
    second.close()


def test_stale_temp_files_are_removed_at_start_and_live_ones_kept(tmp_path: Path) -> None:
    make_disk_tier(tmp_path).close()
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(finished.stdout)
    shard = tmp_path / "ab"
    digest = "ab" + "0" * 62
    dead = shard / f"{digest}.{HOST_TAG}.{dead_pid}.1.00000000.tmp"
    live = shard / f"{digest}.{HOST_TAG}.{os.getpid()}.1.00000001.tmp"
    foreign = shard / f"{digest}.0badc0de.{dead_pid}.1.00000002.tmp"
    old = shard / f"{digest}.0badc0de.{os.getpid()}.1.00000003.tmp"
    for path in (dead, live, foreign, old):
        path.write_bytes(b"partial")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    tier = make_disk_tier(tmp_path)
    assert (dead.exists(), live.exists(), foreign.exists(), old.exists()) == (False, True, True, False)
    assert (tier.stats().extra["temps_removed"], tier.stats().extra["temps_kept"]) == (2, 2)
    assert tier.stats().items == 0
    tier.close()


# --- corruption -------------------------------------------------------------------------


def _flip_value_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[64 + 100] ^= 0x01
    path.write_bytes(bytes(data))


def _flip_header_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x80  # inside the key digest
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 1)


def _truncate_into_header(path: Path) -> None:
    os.truncate(path, 30)


def _append(path: Path) -> None:
    with open(path, "ab") as file:
        file.write(b"\0")


@pytest.mark.parametrize("damage", [_flip_value_byte, _flip_header_byte, _truncate, _truncate_into_header, _append])
def test_a_damaged_file_is_a_counted_miss_and_is_removed(tmp_path: Path, damage) -> None:
    tier = make_disk_tier(tmp_path)
    keys = [key_for(f"d{i}") for i in range(3)]
    tier.put([(key, value_for(key, 4096)) for key in keys])
    damage(record_path(tmp_path, keys[1]))
    assert [None if v is None else bytes(v) for v in tier.get(keys)] == [
        value_for(keys[0], 4096),
        None,
        value_for(keys[2], 4096),
    ]
    stats = tier.stats()
    assert stats.extra["corrupt"] == 1 and stats.items == 2 and stats.bytes_used == 2 * 4096
    assert not record_path(tmp_path, keys[1]).exists()
    assert tier.contains(keys) == [True, False, True]
    tier.close()


def test_a_file_renamed_onto_another_keys_name_is_a_miss_not_the_wrong_value(tmp_path: Path) -> None:
    tier = make_disk_tier(tmp_path)
    a, b = key_for("swap-a"), key_for("swap-b")
    tier.put([(a, value_for("a", 3000)), (b, value_for("b", 3000))])
    os.replace(record_path(tmp_path, a), record_path(tmp_path, b))  # b's name now holds a's record
    assert tier.get([b, a]) == [None, None]
    assert tier.stats().extra["corrupt"] == 1
    assert not record_path(tmp_path, b).exists()
    tier.close()


def test_verify_counts_and_removes_corrupt_files(tmp_path: Path) -> None:
    tier = make_disk_tier(tmp_path)
    keys = [key_for(f"v{i}") for i in range(6)]
    tier.put([(key, value_for(key, 2000)) for key in keys])
    tier.close()
    _flip_value_byte(record_path(tmp_path, keys[0]))
    _truncate(record_path(tmp_path, keys[1]))
    os.replace(record_path(tmp_path, keys[2]), record_path(tmp_path, keys[3]))
    report = verify_folder(tmp_path)
    assert (report.ok, report.corrupt, report.removed, report.ok_bytes) == (2, 3, 0, 4000)
    report = verify_folder(tmp_path, remove_corrupt=True)
    assert (report.corrupt, report.removed) == (3, 3)
    assert verify_folder(tmp_path).corrupt == 0
    assert [record_path(tmp_path, k).exists() for k in keys] == [False, False, False, False, True, True]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        verify_folder(tmp_path / "nowhere")


# --- config -----------------------------------------------------------------------------
# What a queue gives the tier (readable at once, coalesce, cancel, drain or drop on close,
# bounds) is the tier chain's, for every async tier: tests/test_write_queue.py, with this tier.


def test_config_needs_a_path_and_is_written_through_the_chains_queue(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="path"):
        DiskTier.Config()
    queue = DiskTier.Config(path=tmp_path).queue
    assert (queue.mode, queue.max_items, queue.on_full, queue.on_close) == ("async", 64, "drop", "drain")
    partial = DiskTier.Config(path=tmp_path, queue={"max_bytes": "1MiB"}).queue
    assert (partial.mode, partial.max_items, int(partial.max_bytes)) == ("async", 64, 1024**2)
    relative = DiskTier.Config(path="cache")
    assert relative.path.is_absolute() and relative.path.name == "cache"
    assert int(DiskTier.Config(path=tmp_path, max_bytes="2GiB").max_bytes) == 2 * 1024**3


@pytest.mark.parametrize(
    ("old", "value"),
    [("writer", "inline"), ("write_mode", "sync"), ("queue_items", 5), ("queue_bytes", "1MiB"), ("on_close", "flush")],
)
def test_writer_keys_outside_queue_are_unknown_keys(tmp_path: Path, old: str, value: object) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # refused, not accepted with a warning
        with pytest.raises(ValidationError, match=rf"{old}\n  Extra inputs are not permitted"):
            DiskTier.Config(path=tmp_path, **{old: value})


def test_records_list_every_file_of_the_folder_by_digest_and_record_size(tmp_path: Path) -> None:
    first = make_disk_tier(tmp_path)
    first.put([(key_for("old"), b"o" * 10)])
    first.close()
    tier = make_disk_tier(tmp_path)
    tier.put([(key_for("new"), b"n" * 20)])
    listed = sorted((record.digest, record.size) for record in tier.records())
    assert listed == sorted(
        (hashlib.sha256(key_for(k).encode()).hexdigest(), n + 64) for k, n in [("old", 10), ("new", 20)]
    )
    tier.close()


def test_the_tier_does_not_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys, kvplug_disk, kvplug.testing as t\n"
        f"tier = kvplug_disk.DiskTier(kvplug_disk.DiskTier.Config(path={str(tmp_path)!r}), t.tier_context())\n"
        "tier.put([('k', b'v')]); tier.flush(); assert bytes(tier.get(['k'])[0]) == b'v'; tier.close()\n"
        "kvplug_disk.verify_folder(" + repr(str(tmp_path)) + ")\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_items_are_refused_before_anything_is_queued(tmp_path: Path) -> None:
    tier = make_disk_tier(tmp_path)
    strided = memoryview(bytearray(100))[::2]
    with pytest.raises(TypeError, match="contiguous"):
        tier.put([(key_for("ok"), b"fine"), (key_for("strided"), strided)])
    with pytest.raises(TypeError, match="keys are str"):
        tier.put([(b"bytes-key", b"v")])  # type: ignore[list-item]
    tier.flush()
    assert tier.contains([key_for("ok"), key_for("strided")]) == [False, False]
    tier.close()


# --- permissions ------------------------------------------------------------------------


def test_folders_are_0700_and_records_0600_whatever_the_umask(tmp_path: Path) -> None:
    """The folder was 0755, shards 0755, records and the ledger 0644 (with
    umask 022): another local user read cached KV, i.e. prompts."""
    old = os.umask(0o022)
    try:
        tier = make_disk_tier(tmp_path / "cache")
        tier.put([("k", b"v" * 100)])
        tier.close()
    finally:
        os.umask(old)
    root = tmp_path / "cache"
    modes = {path.relative_to(root).as_posix(): path.stat().st_mode & 0o777 for path in [root, *root.rglob("*")]}
    folders = {name: mode for name, mode in modes.items() if (root / name).is_dir()}
    files = {name: mode for name, mode in modes.items() if not (root / name).is_dir()}
    assert set(folders.values()) == {0o700}, folders
    assert set(files.values()) == {0o600}, files
    assert record_path(root, "k").relative_to(root).as_posix() in files


def test_a_folder_of_ours_others_could_read_is_made_private_saying_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "premade"
    folder.mkdir()
    folder.chmod(0o755)
    make_disk_tier(folder).close()
    assert folder.stat().st_mode & 0o777 == 0o700
    assert any("was mode 0755" in r.getMessage() and "made it 0700" in r.getMessage() for r in caplog.records)
