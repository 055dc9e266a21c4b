"""A file under a record's name whose size rules it out is a miss read without allocating
its size: a sparse file of 1 GiB (a few KiB on disk) planted in a real disk tier, read by
an engine's retrieve and by ``kvplug store verify``, with and without an integrity key.

Python's allocator is traced (tracemalloc): a read of the file allocates its size there
(``os.read`` returns one bytes object), so the peak is what the read cost.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import xxhash
from typer.testing import CliRunner

from kvplug import (
    CacheEngine,
    Fingerprint,
    KVLayout,
    PagedFormat,
    TierContext,
    check_record_size,
    key_digest,
    load_config,
)
from kvplug.cli.main import app
from kvplug.core.records import frame as record
from kvplug.core.records.frame import pack_record
from kvplug.errors import CorruptChunkError
from kvplug_disk import DiskTier, DiskTierConfig, verify_folder

T = TypeVar("T")
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
LAYOUT = KVLayout(VLLM_FLASH, num_layers=3, block_size=8, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
TOKENS = list(range(64))  # four chunks of 16
GIB = 1 << 30
#: What reading the planted file may allocate: the engine's own work, nothing of the file's size.
SMALL = 64 << 20
KEY = "an integrity key of thirty-two b"
PLANTS = ("zeros", "torn", "forged")


@pytest.fixture(params=[False, True], ids=["no key", "integrity key"])
def keyed(request: pytest.FixtureRequest) -> Iterator[bool]:
    record.set_integrity_key(KEY.encode() if request.param else None)
    yield request.param
    record.set_integrity_key(...)


def engine_on(folder: Path) -> CacheEngine:
    config = load_config(
        engine_extra={
            "kvplug": {
                "chunk_size": 16,
                "store": {"queue": {"mode": "sync"}},
                "tiers": [{"type": "cpu"}, {"type": "disk", "path": str(folder)}],
            }
        },
        env={},
    ).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m"))


def caches() -> list[torch.Tensor]:
    return [torch.randn(2, 8, 8, 2, 4).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]


def record_path(folder: Path, key: str) -> Path:
    digest = key_digest(key).hex()
    return folder / digest[:2] / f"{digest}.kvr"


def forged_header(key: str, value_length: int) -> bytes:
    """A well-formed header for ``key`` that declares ``value_length`` (its value checksum,
    or MAC, cannot be right: only reading the value could tell)."""
    if record.integrity_key() is not None:
        return struct.pack("<4sHHQ32s16s", b"KVPR", 2, 64, value_length, key_digest(key), b"\0" * 16)
    body = struct.pack("<4sHHQ32sQ", b"KVPR", 1, 64, value_length, key_digest(key), 0)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def plant(path: Path, how: str, key: str) -> None:
    """Replace the record at ``path`` by a sparse file of 1 GiB: zeros, a real record's
    first 4 KiB (its header declares its own small length), or a header declaring 1 GiB."""
    start = {"zeros": b"", "torn": path.read_bytes()[:4096], "forged": forged_header(key, GIB - 64)}[how]
    path.unlink()
    with path.open("wb") as planted:
        planted.write(start)
        planted.truncate(GIB)
    assert path.stat().st_size == GIB and path.stat().st_blocks * 512 < 1 << 20  # sparse: a few KiB on disk


def peak_of(work: Callable[[], T]) -> tuple[T, int]:
    tracemalloc.start()
    try:
        result = work()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("how", PLANTS)
def test_a_retrieve_of_a_planted_sparse_record_is_a_miss_that_allocates_nothing_of_it(
    tmp_path: Path, how: str, keyed: bool
) -> None:
    folder = tmp_path / "kv"
    with engine_on(folder) as writer:
        assert writer.store(TOKENS, caches(), torch.arange(64)) == 64
        writer.flush()
        first = writer.chunk_keys(TOKENS)[0].key
    plant(record_path(folder, first), how, first)
    with engine_on(folder) as reader:
        disk = reader.chain.tiers[1]
        assert reader.lookup(TOKENS) == 64  # a lookup stats the file: it is there
        loaded, peak = peak_of(lambda: reader.retrieve(TOKENS, caches(), torch.arange(64)))
        assert int(loaded.sum()) == 0  # the first chunk missed: nothing loads
        assert peak < SMALL, f"reading a 1 GiB sparse record allocated {peak >> 20} MiB"
        assert disk.stats().extra["corrupt"] == 1  # counted as corrupt like any bad record...
        assert not record_path(folder, first).exists()  # ...and removed
        assert reader.lookup(TOKENS) == 0


@pytest.mark.parametrize("how", PLANTS)
def test_verify_reports_a_planted_sparse_record_as_corrupt_without_allocating_it(
    tmp_path: Path, how: str, keyed: bool
) -> None:
    folder = tmp_path / "kv"
    with engine_on(folder) as writer:
        writer.store(TOKENS, caches(), torch.arange(64))
        writer.flush()
        first = writer.chunk_keys(TOKENS)[0].key
    plant(record_path(folder, first), how, first)
    result, peak = peak_of(lambda: CliRunner().invoke(app, ["store", "verify", str(folder)], env={"COLUMNS": "250"}))
    output = " ".join(result.stdout.split())
    assert result.exit_code == 1, output
    assert f"corrupt: {key_digest(first).hex()}" in output and "│ corrupt │ 1 │" in output, output
    assert peak < SMALL, f"verify of a 1 GiB sparse record allocated {peak >> 20} MiB"
    report, peak = peak_of(lambda: verify_folder(folder))
    assert report.corrupt == 1 and report.ok == 4  # three chunks and the manifest
    assert peak < SMALL, f"verify_folder allocated {peak >> 20} MiB"


def test_the_engine_bounds_its_tiers_records_by_its_largest_chunk(tmp_path: Path) -> None:
    """The bound is the engine's (its chunk's frame, any serializer's framing): every record
    it wrote is within it, and a file of a megabyte and a half is not."""
    with engine_on(tmp_path / "kv") as engine:
        engine.store(TOKENS, caches(), torch.arange(64))
        engine.flush()
        bound = engine.chain.tiers[1].context.max_record_bytes
        assert bound is not None and bound < 3 << 19
        assert all(p.stat().st_size <= bound for p in (tmp_path / "kv").glob("*/*.kvr"))
        engine.chunk_store.reads_chunks_up_to(4 << 20)  # another cache sharing the tiers: raised
        assert engine.chain.tiers[1].context.max_record_bytes > 8 << 20


def test_a_tier_without_a_bound_still_refuses_a_length_its_header_rules_out(tmp_path: Path) -> None:
    tier = DiskTier(DiskTierConfig(path=tmp_path / "kv"), TierContext())
    tier.put([("k", b"v" * 1000)])
    path = record_path(tmp_path / "kv", "k")
    with path.open("ab") as grown:
        grown.write(b"x")
    assert tier.get(["k"]) == [None] and tier.stats().extra["corrupt"] == 1
    tier.close()


@pytest.mark.parametrize(
    ("size", "bound", "start", "message"),
    [
        (GIB, 1 << 20, b"", "over the 1048576 bytes"),
        (GIB, None, b"\0" * 64, "bad record magic"),
        (GIB, None, "real", "record is 1073741824 bytes, header says 1064"),
        (1063, None, "real", "record is 1063 bytes, header says 1064"),
    ],
)
def test_check_record_size_rules(size: int, bound: int | None, start: bytes | str, message: str) -> None:
    header = pack_record("k", b"v" * 1000)[:64] if start == "real" else start
    with pytest.raises(CorruptChunkError, match=message):
        check_record_size(header, size, bound)
    real = pack_record("k", b"v" * 1000)
    check_record_size(real[:64], len(real), len(real))  # a whole record within its bound
    check_record_size(real[:10], 10)  # too short to declare a length: verification refuses it
