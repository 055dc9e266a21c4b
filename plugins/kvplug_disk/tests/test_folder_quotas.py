"""Tenant quotas and pins of folder tiers (``disk``, ``shm``) shared by real processes.

Each process is :mod:`tenant_worker`: a tier of the same folder with ``quotas: {tenant-a: QUOTA}``
and a budget far above what the tests store, so only quotas evict.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from tenant_worker import BUDGET, VALUE, Worker

from kvplug import key_digest
from kvplug.core.tenants import FOLDER_TENANT_BYTES
from kvplug.testing import pins_context, value_for
from kvplug.testing.pins_contract import key_of
from kvplug_disk import DiskTier, ShmTier, budget, verify_folder
from kvplug_disk.folder_scan import RECORD_SUFFIX
from kvplug_disk.ledger import LEDGER_NAME
from kvplug_disk.tenant_tags import (
    MAX_TABLE_TENANTS,
    TAG_SIZE,
    TAG_XATTR,
    decode_usage,
    encode_usage,
    tenant_tag,
)

FILE = VALUE + 64  # a record file: its value and header; quotas count file bytes
QUOTA = 4 * FILE


@pytest.fixture
def workers(kind: str, folder: Path) -> Iterator[list[Worker]]:
    started: list[Worker] = []
    try:
        started.extend(Worker(kind, folder, name, QUOTA) for name in ("w0", "w1"))
        yield started
    finally:
        for worker in started:
            worker.close()


def record_bytes(folder: Path, keys: list[str] | None = None) -> int:
    """File bytes of the folder's records (of ``keys`` only, if given)."""
    names = None if keys is None else {key_digest(key).hex() + RECORD_SUFFIX for key in keys}
    return sum(
        path.stat().st_size for path in folder.glob(f"*/*{RECORD_SUFFIX}") if names is None or path.name in names
    )


def tenant_keys(name: str, tenant: str | None, count: int) -> list[str]:
    return [key_of(tenant, f"{name}-{i}") for i in range(count)]


def test_a_tenants_quota_holds_for_the_folder_not_each_process(workers: list[Worker], folder: Path) -> None:
    """Two engines store tenant-a's chunks in one folder: tenant-a holds at most its quota there
    (0ad3378: each process kept its own quota's worth, 8512 bytes of a 4256-byte quota)."""
    for worker in workers:
        assert worker.ask("put tenant-a 8") == "done"
    held = record_bytes(folder, tenant_keys("w0", "tenant-a", 8) + tenant_keys("w1", "tenant-a", 8))
    assert held <= QUOTA, f"tenant-a holds {held} bytes in the folder, its quota is {QUOTA}"
    # The tenant's most recent records, whichever process wrote them: w1 listed the folder when
    # w0's records filled the quota, and evicted those, the oldest, first.
    assert record_bytes(folder, tenant_keys("w1", "tenant-a", 8)[4:]) == QUOTA
    # Each process reports the tenant's bytes in the whole folder, and those it knows of.
    assert [worker.tenant_a_bytes(FOLDER_TENANT_BYTES) for worker in workers] == [held, held]
    assert all(worker.tenant_a_bytes() <= QUOTA for worker in workers)


def test_writers_at_once_and_one_killed_keep_the_count_and_the_quota(kind: str, folder: Path) -> None:
    """Three processes store tenant-a's chunks at once; one is SIGKILLed while it stores. The
    tenant's count in the ledger is the tagged records' bytes (or, where the kill fell between
    a count and its rename, higher), and once a new process has opened the folder it is exact
    and within the quota."""
    writers = [Worker(kind, folder, f"w{i}", QUOTA) for i in range(3)]
    try:
        for worker in writers:
            worker.send("put tenant-a 30")
        writers[2].process.kill()
        writers[2].process.wait(60)
        for worker in writers[:2]:
            assert worker.answer() == "done"
        counted = ledger_of(folder)[1] or {}
        assert counted.get(tenant_tag("tenant-a"), 0) >= tagged_bytes(folder)
        later = Worker(kind, folder, "later", QUOTA)  # its open lists the folder
        writers.append(later)
        assert ledger_of(folder)[1] == {tenant_tag("tenant-a"): tagged_bytes(folder)}
        assert later.ask("put tenant-a 2") == "done"
        assert tagged_bytes(folder) <= QUOTA
        assert ledger_of(folder)[1] == {tenant_tag("tenant-a"): tagged_bytes(folder)}
    finally:
        for worker in writers:
            worker.close()


def test_a_pinned_chunk_is_not_evicted_for_another_processes_quota(workers: list[Worker], folder: Path) -> None:
    """Process w0 pins a chunk of tenant-a and one of tenant-b, and stores unsalted chunks;
    process w1 then stores far over tenant-a's quota: w1's quota evictions take only its own
    unpinned tenant-a chunks, never w0's pinned ones, nor another tenant's. w0's pinned tenant-a
    chunk, which w1 does not know as pinned, counts against tenant-a's quota in the folder. (w1
    never lists the folder here: what it does not know of, w0's pinned chunk, does not fill the
    quota. Where w1 lists the folder, the pin mark keeps w0's pinned chunk: test_folder_pins.py.)"""
    first, second = workers
    assert first.ask("pin tenant-a system") == "pinned"
    assert first.ask("pin tenant-b system") == "pinned"
    assert first.ask("put none 3") == "done"
    assert second.ask("put tenant-a 12") == "done"
    pinned = [key_of("tenant-a", "system"), key_of("tenant-b", "system")]
    assert record_bytes(folder, pinned) == 2 * FILE, "a pinned chunk left the folder"
    assert record_bytes(folder, tenant_keys("w0", None, 3)) == 3 * FILE, "unsalted chunks were evicted"
    assert record_bytes(folder, tenant_keys("w1", "tenant-a", 12)) == QUOTA - FILE
    assert int(str(second.stats()["quota_evictions"])) >= 8
    # What a process reports is its own view: w1 counts only the tenant-a bytes it wrote.
    assert second.tenant_a_bytes() <= QUOTA
    assert int(str(first.stats()["pinned_bytes"])) == 2 * FILE


def open_tier(kind: str, folder: Path) -> DiskTier:
    """A tier of ``folder`` in this process, as :mod:`tenant_worker` opens it."""
    tier_type = ShmTier if kind == "shm" else DiskTier
    config = tier_type.Config(path=folder, fsync=False, max_bytes=BUDGET, quotas={"tenant-a": QUOTA})  # type: ignore[call-arg]
    return tier_type(config, pins_context())


def ledger_of(folder: Path) -> tuple[int | None, dict[bytes, int] | None]:
    return decode_usage((folder / LEDGER_NAME).read_bytes())


def put(tier: DiskTier, keys: list[str]) -> None:
    for key in keys:
        tier.put([(key, value_for(key, VALUE))])


def test_records_and_ledgers_of_older_kvplug_stay_readable(kind: str, folder: Path) -> None:
    """A folder an older kvplug wrote: records without a tenant tag, an 8-byte ledger. They
    are read as before and count for no tenant of the folder; the table is rebuilt at open."""
    tier = open_tier(kind, folder)
    old = tenant_keys("old", "tenant-a", 3)
    put(tier, old)
    tier.close()
    for path in folder.glob(f"*/*{RECORD_SUFFIX}"):
        os.removexattr(path, TAG_XATTR)  # what an older kvplug wrote: no tag
    ledger = folder / LEDGER_NAME
    ledger.write_bytes(ledger.read_bytes()[:8])  # and its ledger: the total alone
    tier = open_tier(kind, folder)
    assert ledger_of(folder)[1] == {}  # rebuilt: those records are no tenant's in the folder
    assert [bytes(value) for value in tier.get(old)] == [value_for(key, VALUE) for key in old]  # type: ignore[arg-type]
    new = tenant_keys("new", "tenant-a", 4)
    put(tier, new)
    assert ledger_of(folder)[1] == {tenant_tag("tenant-a"): tagged_bytes(folder)}
    assert tagged_bytes(folder) <= QUOTA
    assert record_bytes(folder, old + new) == QUOTA  # the old ones it read count in this process, as before
    tier.close()


def test_a_listing_counts_the_tags_of_record_files_alone(kind: str, folder: Path, tmp_path: Path) -> None:
    """The table rebuilt at open (each record's tag read as the folder is listed) counts regular
    record files only: a tag of the wrong length is no tag, a link named like a record is not
    followed to the tagged file it names, and a folder named like one, tagged, is no record."""
    tier = open_tier(kind, folder)
    keys = tenant_keys("a", "tenant-a", 3)
    put(tier, keys)
    tier.close()
    tag = tenant_tag("tenant-a")
    paths = [folder / key_digest(key).hex()[:2] / f"{key_digest(key).hex()}{RECORD_SUFFIX}" for key in keys]
    os.setxattr(paths[0], TAG_XATTR, tag + b"x")
    outside = tmp_path / "outside"
    outside.write_bytes(paths[1].read_bytes())
    os.setxattr(outside, TAG_XATTR, tag)
    paths[1].unlink()
    paths[1].symlink_to(outside)
    digest = key_digest(key_of("tenant-a", "a folder")).hex()
    planted = folder / digest[:2] / f"{digest}{RECORD_SUFFIX}"
    planted.mkdir()
    os.setxattr(planted, TAG_XATTR, tag)
    tier = open_tier(kind, folder)
    try:
        assert ledger_of(folder)[1] == {tag: FILE}  # the third record's alone
        assert tier.stats().items == 2  # the first (a record without a tag) and the third
    finally:
        tier.close()


def tagged_bytes(folder: Path, tenant: str = "tenant-a") -> int:
    """File bytes of the records carrying ``tenant``'s tag."""
    tag = tenant_tag(tenant)
    return sum(
        path.stat().st_size
        for path in folder.glob(f"*/*{RECORD_SUFFIX}")
        if TAG_XATTR in os.listxattr(path) and os.getxattr(path, TAG_XATTR) == tag
    )


def test_a_count_left_too_high_by_a_crash_is_rebuilt(kind: str, folder: Path) -> None:
    """A process killed between counting its record and renaming it into place leaves the
    tenant's count too high (written here as such a kill leaves it). The next process to open
    the folder lists it and counts again; so does a process with nothing of the tenant left to evict."""
    tier = open_tier(kind, folder)
    put(tier, tenant_keys("a", "tenant-a", 2))
    tier.close()
    total, tenants = ledger_of(folder)
    assert total is not None and tenants == {tenant_tag("tenant-a"): 2 * FILE}
    ledger = folder / LEDGER_NAME
    ledger.write_bytes(encode_usage(total + 9 * VALUE, {tenant_tag("tenant-a"): 11 * FILE}))  # 9 records never renamed
    tier = open_tier(kind, folder)
    assert ledger_of(folder) == (total, {tenant_tag("tenant-a"): 2 * FILE})
    put(tier, tenant_keys("b", "tenant-a", 2))
    assert record_bytes(folder) == QUOTA
    ledger.write_bytes(encode_usage(total + 9 * VALUE, {tenant_tag("tenant-a"): 13 * FILE}))  # while it runs
    put(tier, tenant_keys("c", "tenant-a", 1))  # what it does not know fills the quota: it lists the folder
    assert ledger_of(folder)[1] == {tenant_tag("tenant-a"): QUOTA}
    assert record_bytes(folder, tenant_keys("c", "tenant-a", 1)) == FILE  # the record just written stays
    assert record_bytes(folder) == QUOTA
    tier.close()


def test_gc_takes_a_removed_record_off_its_tenants_count(kind: str, folder: Path) -> None:
    tier = open_tier(kind, folder)
    keys = tenant_keys("a", "tenant-a", 3)
    put(tier, keys)
    tier.close()
    path = next(folder.glob(f"*/{key_digest(keys[0]).hex()}{RECORD_SUFFIX}"))
    with path.open("r+b") as record:  # a bit flipped in its value: corrupt
        record.seek(100)
        byte = record.read(1)
        record.seek(100)
        record.write(bytes([byte[0] ^ 1]))
    assert verify_folder(folder, remove_corrupt=True).removed == 1
    assert ledger_of(folder)[1] == {tenant_tag("tenant-a"): 2 * FILE}


def peak_memory(process: subprocess.Popen[str]) -> int:
    """The most memory ``process`` has held so far (its ``VmHWM``), in bytes."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:"))


def test_a_ledger_file_longer_than_any_table_is_not_read_whole(kind: str, folder: Path) -> None:
    """The ledger made 512 MiB long (sparse: a local user's truncate, a disk's error) is read as its
    total alone, and written back as a table again: a tier opening the folder or writing into it does
    not read it whole (6834e34: the worker's peak memory was over 512 MiB; at 1 TiB its open failed
    with MemoryError)."""
    tier = open_tier(kind, folder)
    put(tier, tenant_keys("a", "tenant-a", 2))
    tier.close()
    total = ledger_of(folder)[0]
    with (folder / LEDGER_NAME).open("r+b") as ledger:
        ledger.truncate(512 * 1024**2)
    worker = Worker(kind, folder, "w0", QUOTA)
    try:
        assert worker.ask("put tenant-a 1") == "done"
        assert peak_memory(worker.process) < 256 * 1024**2
        assert ledger_of(folder) == (total + VALUE, {tenant_tag("tenant-a"): tagged_bytes(folder)})
        assert tagged_bytes(folder) == 3 * FILE
    finally:
        worker.close()


def test_a_torn_or_stale_tenant_table_reads_as_none() -> None:
    tenants = {tenant_tag("tenant-a"): 5, tenant_tag("tenant-b"): 7}
    data = encode_usage(100, tenants)
    assert decode_usage(data) == (100, tenants)
    many = {i.to_bytes(TAG_SIZE, "little"): 1 for i in range(MAX_TABLE_TENANTS + 1)}
    assert decode_usage(encode_usage(100, many)) == (100, None)  # past the bound: no table, the total kept
    del many[bytes(TAG_SIZE)]
    assert decode_usage(encode_usage(100, many)) == (100, many)
    assert decode_usage(data[:-1]) == (100, None)  # torn
    assert decode_usage((101).to_bytes(8, "little") + data[8:]) == (101, None)  # an older kvplug changed the total
    assert decode_usage(data[:8]) == (100, None)  # an older kvplug's ledger
    assert decode_usage(b"") == (None, None)


def test_an_older_kvplug_writing_beside_makes_the_folder_listed_at_most_so_often(
    kind: str, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An older kvplug changes the ledger's total at each write, which makes the tenant table
    stale: a tier with quotas lists the folder to count again, but not at each write."""
    now = [0.0]
    monkeypatch.setattr(budget, "clock", lambda: now[0])  # (time stands still: a stale table within the interval)
    tier = open_tier(kind, folder)  # its open lists the folder
    ledger = folder / LEDGER_NAME

    def older_kvplug_writes() -> None:
        with ledger.open("r+b") as file:  # what an older kvplug's write does to the ledger: its total alone
            file.write((int.from_bytes(file.read(8), "little") + 1).to_bytes(8, "little"))

    put(tier, tenant_keys("a", "tenant-a", 2))
    assert ledger_of(folder)[1] == {tenant_tag("tenant-a"): 2 * FILE}
    older_kvplug_writes()
    put(tier, tenant_keys("b", "tenant-a", 1))
    assert ledger_of(folder)[1] is None  # not listed again so soon: no table, quotas per process meanwhile
    now[0] += budget.TENANT_RELIST_INTERVAL_S
    put(tier, tenant_keys("c", "tenant-a", 1))
    assert ledger_of(folder)[1] == {tenant_tag("tenant-a"): 4 * FILE}
    tier.close()
