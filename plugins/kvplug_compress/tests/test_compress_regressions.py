"""The named hostile-frame regressions for zstd, lz4, int8 and fp8, each run in a fresh process.

As in test_compress_fuzz.py (whose frame builders these use): whatever the frame says,
``loads`` must end in a specific ``ChunkError`` subclass or a tensor of the right shape,
within 1 s, allocating less than twice the chunk (:mod:`kvplug.testing.decode_bounds`),
in a subprocess (this file as a script) with a capped address space.

The regressions are these frames: a 32 KB zstd plane declaring 1 GiB
(through the serializer, and as a forged disk record through ``CacheEngine``), a 104-byte
frame of 1-element segments for an 8B model's chunk, a 160-byte frame declaring 8 GiB
read without ``expected_shape``, and int8/fp8 frames with a zero last dimension.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_compress_fuzz import GiB, MiB, lossless_header, make, sealed, with_plane, zstd_zeros

import kvplug
from kvplug.core.records.frame import pack_record
from kvplug.errors import CorruptChunkError
from kvplug.testing import assert_bounded, cap_memory, measure_decode, run_fresh
from kvplug_compress import ZstdSerializer
from kvplug_compress import frame as kvpc


def zstd_plane_declaring_1gib() -> None:
    """A 32 KB plane that declares (and holds) 1 GiB of zeros.

    In a 128 KiB chunk (one segment, planes of 64 KiB), so that the frame is smaller
    than its chunk, as an encoded frame is, and only the plane's declared size is wrong.
    """
    serializer = ZstdSerializer(ZstdSerializer.Config())
    chunk = (torch.randn((2, 2, 64, 256), generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16)
    blob = zstd_zeros(GiB, GiB)
    assert len(blob) < 33 * 1024
    frame = sealed(with_plane(bytes(serializer.dumps(chunk)), 0, blob))
    assert len(frame) < chunk.numel() * 2
    cap_memory()
    cost = measure_decode(lambda: serializer.loads(frame, expected_shape=chunk.shape, expected_dtype=chunk.dtype))
    assert_bounded(cost, chunk_bytes=chunk.numel() * 2)
    assert isinstance(cost.error, CorruptChunkError) and "declares 1073741824 bytes" in str(cost.error), cost.error


#: A chunk of an 8B model (Llama 3 8B: 32 layers, K and V, 256 tokens, 8 heads x 128) in bf16.
LLAMA_8B_CHUNK = (32, 2, 256, 1024)


def one_element_segments(name: str) -> None:
    """104 bytes (8 of payload) whose segments are 1 element each."""
    frame = sealed(lossless_header(name, "bfloat16", LLAMA_8B_CHUNK, 1, b"\0" * 8))
    assert len(frame) == 104
    serializer = make(name)
    cap_memory()
    cost = measure_decode(lambda: serializer.loads(frame, expected_shape=LLAMA_8B_CHUNK, expected_dtype=torch.bfloat16))
    assert_bounded(cost, chunk_bytes=32 * MiB)
    assert isinstance(cost.error, CorruptChunkError), cost.error


def declares_8gib_without_expected_shape(name: str) -> None:
    """160 bytes declaring an 8 GiB float64 chunk in one segment, read with ``loads(frame)``."""
    table = struct.pack("<8I", *[4] * 8)
    frame = sealed(lossless_header(name, "float64", (32768, 32768), 2**32 - 1, table + b"\xff" * 32))
    assert len(frame) == 160
    serializer = make(name)
    cap_memory()
    cost = measure_decode(lambda: serializer.loads(frame))
    assert_bounded(cost, chunk_bytes=MiB)
    assert isinstance(cost.error, CorruptChunkError) and "max_chunk_bytes" in str(cost.error), cost.error


def zero_last_dimension(name: str) -> None:
    """An encoded int8/fp8 frame of shape (4, 0) divided by its zero width."""
    frame = sealed(
        bytearray(
            kvpc.pack_header(name, "bfloat16", (4, 0), encoding=kvpc.ENCODED, param_a=64, param_b=1, payload_length=0)
        )
    )
    serializer = make(name)
    cost = measure_decode(lambda: serializer.loads(frame))
    assert_bounded(cost, chunk_bytes=MiB)
    assert isinstance(cost.error, CorruptChunkError), cost.error


def group_wider_than_the_row(name: str) -> None:
    """A quantized frame whose group (2**32 - 1) is far wider than its rows of 1: nothing is padded to it."""
    rows = 1024
    payload = struct.pack(f"<{rows}e", *[1.0] * rows) + bytes(rows)  # fp16 scales of 1, codes of 0
    header = kvpc.pack_header(
        name, "bfloat16", (rows, 1), encoding=kvpc.ENCODED, param_a=2**32 - 1, param_b=1, payload_length=len(payload)
    )
    frame = sealed(bytearray(header) + payload)
    serializer = make(name)
    cap_memory()
    cost = measure_decode(lambda: serializer.loads(frame))
    assert_bounded(cost, chunk_bytes=2 * rows, shape=(rows, 1))


def forged_disk_record(tmp: str) -> None:
    """Through CacheEngine: a ~65 KB disk record whose zstd plane declares 2 GiB."""
    from test_compress_engine import TOKENS, caches, engine, slots

    path = Path(tmp)
    source = caches(seed=1)
    serializer = {"type": "zstd", "segment_bytes": 4096}
    with engine(path, serializer) as writer:
        assert writer.store(TOKENS, source, slots(range(8))) == len(TOKENS)
        writer.flush()
        keys = [k.key for k in writer.chunk_keys(TOKENS)]
        shape = writer.layout.chunk_shape(8)
    victim = record_of(path, keys[1])
    valid = bytes(kvplug.unpack_record(victim.read_bytes(), keys[1]))
    assert valid[33] == kvpc.ENCODED
    record = pack_record(keys[1], sealed(with_plane(valid, 0, zstd_zeros(2 * GiB, 2 * GiB))))
    assert len(record) < 70 * 1024
    target = caches(seed=9)
    with engine(path, serializer) as reader:  # warm-up: the first retrieve of a process pays for more than chunks
        assert bool(reader.retrieve(TOKENS, target, slots(range(8, 16))).all())
    victim.write_bytes(record)
    with engine(path, serializer) as reader:
        cap_memory()
        cost = measure_decode(lambda: reader.retrieve(TOKENS, target, slots(range(8, 16))))
    chunk_bytes = int(torch.Size(shape).numel()) * 2
    assert cost.error is None, cost.error
    assert cost.result.tolist() == [True] * 8 + [False] * 24  # the prefix ends at the forged chunk
    assert cost.seconds < 1.0, cost.seconds
    # The engine's own work (reading records, the cache writes) is not the chunk's: 8 MiB of room.
    assert cost.traced_bytes < 8 * MiB, cost.traced_bytes
    assert cost.rss_growth_bytes < 2 * chunk_bytes + 64 * MiB, cost.rss_growth_bytes


def record_of(path: Path, key: str) -> Path:
    digest = kvplug.key_digest(key).hex()
    matches = [p for p in path.rglob("*") if p.is_file() and digest in p.name]
    assert len(matches) == 1, key
    return matches[0]


CASES: dict[str, Callable[..., None]] = {
    "zstd_plane_declaring_1gib": zstd_plane_declaring_1gib,
    "one_element_segments": one_element_segments,
    "declares_8gib_without_expected_shape": declares_8gib_without_expected_shape,
    "zero_last_dimension": zero_last_dimension,
    "group_wider_than_the_row": group_wider_than_the_row,
    "forged_disk_record": forged_disk_record,
}

# --- the tests ------------------------------------------------------------------------

HERE = Path(__file__)


def test_a_zstd_plane_declaring_1gib_is_refused_before_decompressing() -> None:
    run_fresh(HERE, "zstd_plane_declaring_1gib")


def test_a_forged_disk_record_declaring_2gib_is_a_miss_without_the_allocation(tmp_path: Path) -> None:
    run_fresh(HERE, "forged_disk_record", str(tmp_path))


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_one_element_segments_are_refused_before_the_table_is_built(name: str) -> None:
    run_fresh(HERE, "one_element_segments", name)


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_a_frame_over_max_chunk_bytes_is_refused_without_expected_shape(name: str) -> None:
    run_fresh(HERE, "declares_8gib_without_expected_shape", name)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_zero_last_dimension_is_a_corrupt_chunk(name: str) -> None:
    run_fresh(HERE, "zero_last_dimension", name)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_group_wider_than_the_row_decodes_without_padding_to_it(name: str) -> None:
    run_fresh(HERE, "group_wider_than_the_row", name)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    CASES[sys.argv[1]](*sys.argv[2:])
