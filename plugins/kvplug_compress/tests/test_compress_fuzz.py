"""Hostile frames for zstd, lz4, int8 and fp8: bounded time and memory, a specific error.

Anyone who can write a store can write a frame, and its checksum is no obstacle (xxh3 is
not a MAC): every frame here is resealed after it is mutated, unless the mutation is the
checksum. Whatever the frame says, ``loads`` must end in a specific ``ChunkError``
subclass or a tensor of the right shape, within 1 s, allocating less than twice the
chunk (:mod:`kvplug.testing.decode_bounds`). The decodes run in a fresh subprocess (this
file as a script) with a capped address space, so that the peak RSS means something and
a build without the bounds fails there instead of exhausting the machine.

The named regressions (frames that once got through) are in test_compress_regressions.py.
"""

from __future__ import annotations

import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvplug
from kvplug.errors import CorruptChunkError
from kvplug.testing import assert_bounded, cap_memory, measure_decode, run_fresh
from kvplug_compress import FP8Serializer, Int8Serializer, LZ4Serializer, ZstdSerializer
from kvplug_compress import frame as kvpc

SERIALIZERS: dict[str, type[kvplug.Serializer]] = {
    "zstd": ZstdSerializer,
    "lz4": LZ4Serializer,
    "int8": Int8Serializer,
    "fp8": FP8Serializer,
}
# Small segments: the fuzz chunks span two, so the segment table and the thread pool are in play.
OPTIONS: dict[str, dict[str, Any]] = {"zstd": {"segment_bytes": 4096, "threads": 2}, "lz4": {"segment_bytes": 4096}}
RAW_PLANE = 0x8000_0000
MiB = 2**20
GiB = 2**30

#: KVPC header fields the fuzz sets: name -> (offset, struct format); see kvplug_compress.frame.
FIELDS: dict[str, tuple[int, str]] = {
    "magic": (0, "4s"),
    "version": (4, "H"),
    "header_size": (6, "H"),
    "codec": (8, "8s"),
    "dtype": (16, "16s"),
    "ndim": (32, "B"),
    "encoding": (33, "B"),
    **{f"dim{i}": (36 + 4 * i, "I") for i in range(6)},
    "param_a": (60, "I"),
    "param_b": (64, "i"),
    "payload_length": (72, "Q"),
    "checksum": (80, "Q"),
}


def make(name: str) -> kvplug.Serializer:
    cls = SERIALIZERS[name]
    return cls(cls.Config(**OPTIONS.get(name, {})))


# --- frames ---------------------------------------------------------------------------


def zstd_zeros(content: int, declared: int | None) -> bytes:
    """A zstd frame of ``content`` zero bytes as RLE blocks (4 bytes per 128 KiB): 1 GiB in 32 KB.

    Its header declares ``declared`` bytes (None: no content size), whatever it holds.
    """
    descriptor = 3 << 6 if declared is not None else 0  # 8-byte content size field, or none
    out = bytearray(struct.pack("<IBB", 0xFD2FB528, descriptor, 7 << 3))  # window 2**17
    if declared is not None:
        out += struct.pack("<Q", declared)
    left = content
    while True:
        size = min(1 << 17, left)
        left -= size
        out += (int(left == 0) | 1 << 1 | size << 3).to_bytes(3, "little") + b"\0"  # last flag, RLE, size
        if left == 0:
            return bytes(out)


def set_field(frame: bytearray, field: str, value: int | bytes) -> None:
    offset, fmt = FIELDS[field]
    struct.pack_into("<" + fmt, frame, offset, value)


def fix_length(frame: bytearray) -> None:
    set_field(frame, "payload_length", len(frame) - kvpc.HEADER_SIZE)


def sealed(frame: bytearray, *, fix_length_field: bool = True) -> bytes:
    if fix_length_field:
        fix_length(frame)
    kvpc.seal(frame)
    return bytes(frame)


def with_plane(frame: bytes, index: int, blob: bytes, *, stored: bool = False) -> bytearray:
    """A lossless frame with plane ``index`` (segment-major) replaced by ``blob``; unsealed."""
    header = kvpc.verify(frame, frame[8:16].rstrip(b"\0").decode())
    payload = memoryview(frame)[kvpc.HEADER_SIZE :]
    count = -(-header.numel // header.param_a) * header.itemsize
    lengths = list(struct.unpack_from(f"<{count}I", payload))
    blobs, position = [], 4 * count
    for length in lengths:
        blobs.append(bytes(payload[position : position + (length & ~RAW_PLANE)]))
        position += length & ~RAW_PLANE
    blobs[index], lengths[index] = blob, len(blob) | (RAW_PLANE if stored else 0)
    return bytearray(frame[: kvpc.HEADER_SIZE]) + struct.pack(f"<{count}I", *lengths) + b"".join(blobs)


def lossless_header(codec: str, dtype: str, shape: tuple[int, ...], per_segment: int, payload: bytes) -> bytearray:
    header = kvpc.pack_header(
        codec, dtype, shape, encoding=kvpc.ENCODED, param_a=per_segment, param_b=1, payload_length=len(payload)
    )
    return bytearray(header) + payload


@dataclass(frozen=True)
class Base:
    """A valid frame the fuzz starts from."""

    frame: bytes
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def chunk_bytes(self) -> int:
        return int(torch.Size(self.shape).numel()) * self.dtype.itemsize


def bases(name: str, serializer: kvplug.Serializer) -> list[Base]:
    generator = torch.Generator().manual_seed(29)
    kv = (torch.randn((2, 2, 8, 128), generator=generator) * 3).to(torch.bfloat16)
    odd = torch.randn((2, 2, 8, 96), generator=generator).to(torch.bfloat16)  # groups of 64 leave a remainder
    noise = torch.randint(-128, 128, (2, 2, 8, 64), dtype=torch.int8, generator=generator)
    tensors = [kv, odd, noise.view(torch.float8_e4m3fn) if name in ("int8", "fp8") else noise.view(torch.bfloat16)]
    out = [Base(bytes(serializer.dumps(t)), tuple(t.shape), t.dtype) for t in tensors]
    encodings = [b.frame[33] for b in out]
    assert encodings == [kvpc.ENCODED, kvpc.ENCODED, kvpc.STORED], encodings  # both paths are fuzzed
    return out


# --- the fuzz -------------------------------------------------------------------------


def fuzz(name: str, examples: int) -> None:
    """Hypothesis over header fields and payload bytes of valid frames, every decode bounded."""
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    serializer = make(name)
    starts = bases(name, serializer)
    for base in starts:  # warm-up: first calls build thread pools and codec contexts
        serializer.loads(base.frame, expected_shape=base.shape)
    cap_memory()

    extremes = [0, 1, 2, 3, 7, 8, 63, 64, 65, 127, 255, 511, 2047, 2048, 4095, 4096, 65535, 2**20, 2**30]
    extremes += [2**31 - 1, 2**31, 2**32 - 1]
    names = [b"zstd", b"lz4", b"int8", b"fp8", b"KVPL", b"KVPC", b"bfloat16", b"float64", b"float8_e4m3fn", b""]

    def values(fmt: str) -> st.SearchStrategy[Any]:
        if fmt.endswith("s"):
            return st.sampled_from(names) | st.binary(max_size=int(fmt[:-1]))
        bits = struct.calcsize(fmt) * 8
        low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if fmt.islower() else (0, 2**bits - 1)
        edge = [v for v in [*extremes, high, low, -1] if low <= v <= high]
        return st.sampled_from(edge) | st.integers(low, high)

    field_ops = st.sampled_from(sorted(FIELDS)).flatmap(
        lambda field: st.tuples(st.just("field"), st.just(field), values(FIELDS[field][1]))
    )
    byte_ops = st.one_of(
        st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
        st.tuples(st.just("u32"), st.integers(0, 64), st.sampled_from([*extremes, RAW_PLANE, RAW_PLANE | 4096])),
        st.tuples(st.just("truncate"), st.floats(0, 1)),
        st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
        # A whole shape at once (several huge dims with a zero among them), and a frame
        # left with no payload, as an empty chunk's stored frame has.
        st.tuples(st.just("shape"), st.lists(values("I") | st.just(0), max_size=6)),
        st.tuples(st.just("no_payload")),
    )
    plane_ops = st.tuples(
        st.just("plane"),
        st.integers(0, 3),
        st.sampled_from([1, 2047, 2048, 2049, 1 << 17, GiB, 2 * GiB - 1]),  # bytes the frame holds
        st.sampled_from([None, 0, 2047, 2048, 2049, GiB, 2**64 - 1]),  # bytes it declares (None: no size)
        st.booleans(),  # a zstd frame, or random bytes
    )
    ops = field_ops | byte_ops | plane_ops if name in ("zstd", "lz4") else field_ops | byte_ops

    def apply(base: Base, op: tuple[Any, ...], frame: bytearray) -> bytearray:
        kind = op[0]
        if kind == "field" and len(frame) >= kvpc.HEADER_SIZE:
            set_field(frame, op[1], op[2])
        elif kind == "flip" and frame:
            frame[min(len(frame) - 1, int(op[1] * len(frame)))] ^= op[2]
        elif kind == "u32" and kvpc.HEADER_SIZE + op[1] + 4 <= len(frame):
            struct.pack_into("<I", frame, kvpc.HEADER_SIZE + op[1], op[2])
        elif kind == "truncate":
            del frame[int(op[1] * len(frame)) :]
        elif kind == "extend":
            frame += op[1]
        elif kind == "shape" and len(frame) >= kvpc.HEADER_SIZE:
            struct.pack_into("<B", frame, 32, len(op[1]))
            struct.pack_into(f"<{len(op[1])}I", frame, 36, *op[1])
        elif kind == "no_payload":
            del frame[kvpc.HEADER_SIZE :]
        elif kind == "plane" and base.frame[33] == kvpc.ENCODED:
            _, index, content, declared, zstd_blob = op
            blob = zstd_zeros(content, declared) if zstd_blob else bytes(range(256)) * 8
            frame = with_plane(base.frame, index, blob)
        return frame

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(
        st.sampled_from(range(len(starts))),
        st.lists(ops, min_size=1, max_size=3),
        st.integers(0, 9),
        st.booleans(),
    )
    def check(start: int, mutations: list[tuple[Any, ...]], seal: int, with_expected: bool) -> None:
        base = starts[start]
        frame = bytearray(base.frame)
        for op in mutations:
            frame = apply(base, op, frame)
        fields = {op[1] for op in mutations if op[0] == "field"}
        if seal and len(frame) >= kvpc.HEADER_SIZE and "checksum" not in fields:  # 1 in 10 keeps its checksum
            frame = bytearray(sealed(frame, fix_length_field="payload_length" not in fields))
        data = bytes(frame)
        expected = base.shape if with_expected else None
        dtype = base.dtype if with_expected else None

        def decode() -> torch.Tensor:
            return serializer.loads(data, expected_shape=expected, expected_dtype=dtype)

        shape = expected
        if not with_expected and len(data) >= kvpc.HEADER_SIZE and data[32] <= 6:  # the header's own
            shape = struct.unpack_from(f"<{data[32]}I", data, 36)
        cost = measure_decode(decode)
        assert_bounded(cost, chunk_bytes=base.chunk_bytes, shape=shape, context=f"{name} {mutations}")

    # The frames, as this fuzz writes them: tried first, every run.
    regressions: list[list[tuple[Any, ...]]] = [
        [("field", "dim3", 0)],  # a zero last dimension (int8, fp8)
        [("field", "param_a", 2**32 - 1)],  # a group (or segment) far wider than a row
        [("field", "dim0", 2**20)],  # a chunk of 2 GiB, read without expected_shape
    ]
    # An empty stored chunk whose other dims overflow torch's strides (start 2 is stored).
    empty_huge = [("shape", [0, 2**32 - 1, 2**32 - 1, 2**32 - 1]), ("no_payload",)]
    if name in ("zstd", "lz4"):
        regressions += [
            [("field", "param_a", 1)],  # 1-element segments
            [("plane", 0, 2048, GiB, True)],  # a small zstd plane declaring 1 GiB
            [("plane", 0, GiB, GiB, True)],  # a 32 KB one holding it
        ]
    for mutations in regressions:
        check = example(0, mutations, 1, False)(check)
    check = example(2, empty_huge, 1, False)(check)
    check()


CASES: dict[str, Callable[..., None]] = {
    "fuzz": lambda name, examples: fuzz(name, int(examples)),
}

# --- the tests ------------------------------------------------------------------------

HERE = Path(__file__)


@pytest.mark.parametrize("name", sorted(SERIALIZERS))
def test_hostile_frames_end_fast_in_a_chunk_error_or_the_right_shape(name: str) -> None:
    run_fresh(HERE, "fuzz", name, "150")


@pytest.mark.parametrize("name", sorted(SERIALIZERS))
def test_max_chunk_bytes_bounds_loads_without_expected_shape(name: str) -> None:
    serializer = make(name)
    base = bases(name, serializer)[0]
    assert serializer.loads(base.frame).shape == base.shape  # the default bound (1 GiB) holds it
    serializer.max_chunk_bytes = base.chunk_bytes - 1
    with pytest.raises(CorruptChunkError, match=rf"over the maximum chunk of {base.chunk_bytes - 1} bytes"):
        serializer.loads(base.frame)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    CASES[sys.argv[1]](*sys.argv[2:])
