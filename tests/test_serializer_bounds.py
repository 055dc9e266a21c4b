"""Serializer ``raw`` on hostile frames, and the ``max_chunk_bytes`` bound.

The fuzz mutates header fields of valid ``KVPL`` frames to extreme values and flips,
truncates and extends their bytes, resealing them (xxh3 is no obstacle to whoever can
write a store): every decode must end within 1 s, in a specific ``ChunkError`` or a
tensor of the right shape, allocating less than twice the chunk. It runs in a fresh,
memory-capped subprocess (this file as a script; see :mod:`kvplug.testing.decode_bounds`).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvplug import CacheEngine, Fingerprint, KVPlugConfig, get_registry, load_config
from kvplug.builtins.raw_serializer import RawSerializer
from kvplug.core import chunk_format
from kvplug.core.components import EmptyConfig
from kvplug.core.serializer_factory import make_serializer
from kvplug.errors import ConfigError, CorruptChunkError
from kvplug.testing import assert_bounded, cap_memory, measure_decode, run_fresh

HERE = Path(__file__)

#: KVPL header fields: name -> (offset, struct format); see kvplug.core.chunk_format.
FIELDS: dict[str, tuple[int, str]] = {
    "magic": (0, "4s"),
    "version": (4, "H"),
    "header_size": (6, "H"),
    "dtype": (8, "16s"),
    "ndim": (24, "B"),
    **{f"dim{i}": (28 + 4 * i, "I") for i in range(6)},
    "payload_length": (56, "Q"),
    "reserved": (64, "16s"),
    "checksum": (80, "Q"),
}


def fuzz(examples: int) -> None:
    from hypothesis import HealthCheck, example, given, settings
    from hypothesis import strategies as st

    serializer = RawSerializer(EmptyConfig())
    generator = torch.Generator().manual_seed(29)
    tensors = [
        torch.randn((2, 2, 8, 128), generator=generator).to(torch.bfloat16),
        torch.randn((3, 5), generator=generator),
        torch.empty((4, 0), dtype=torch.float16),
    ]
    starts = [
        (bytes(serializer.dumps(t)), tuple(t.shape), t.dtype, max(64, t.numel() * t.element_size())) for t in tensors
    ]
    for frame, shape, _, _ in starts:  # warm-up
        serializer.loads(frame, expected_shape=shape)
    cap_memory()

    extremes = [0, 1, 2, 3, 6, 7, 8, 96, 255, 4095, 4096, 65535, 2**20, 2**30, 2**31 - 1, 2**31, 2**32 - 1]
    names = [b"KVPL", b"KVPC", b"bfloat16", b"float64", b"float8_e4m3fn", b"int8", b""]

    def values(fmt: str) -> st.SearchStrategy[Any]:
        if fmt.endswith("s"):
            return st.sampled_from(names) | st.binary(max_size=int(fmt[:-1]))
        high = 2 ** (struct.calcsize(fmt) * 8) - 1
        return st.sampled_from([v for v in [*extremes, high, 2**63] if v <= high]) | st.integers(0, high)

    ops = st.one_of(
        st.sampled_from(sorted(FIELDS)).flatmap(
            lambda field: st.tuples(st.just("field"), st.just(field), values(FIELDS[field][1]))
        ),
        st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
        st.tuples(st.just("truncate"), st.floats(0, 1)),
        st.tuples(st.just("extend"), st.binary(min_size=1, max_size=64)),
        # A whole shape at once: several huge dims with a zero among them (an empty chunk).
        st.tuples(st.just("shape"), st.lists(values("I") | st.just(0), max_size=6)),
    )

    @settings(
        max_examples=examples, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
    )
    @example(0, [("field", "dim0", 2**20)], 1, False)  # a header over max_chunk_bytes
    @example(2, [("field", "dim0", 2**32 - 1)], 1, False)  # an empty chunk of a huge shape
    @example(2, [("shape", [0, 2**32 - 1, 2**32 - 1, 2**32 - 1])], 1, False)  # whose strides overflow torch's
    @given(st.sampled_from(range(len(starts))), st.lists(ops, min_size=1, max_size=3), st.integers(0, 9), st.booleans())
    def check(start: int, mutations: list[tuple[Any, ...]], seal: int, with_expected: bool) -> None:
        base, base_shape, base_dtype, chunk_bytes = starts[start]
        frame = bytearray(base)
        for op in mutations:
            if op[0] == "field" and len(frame) >= chunk_format.HEADER_SIZE:
                offset, fmt = FIELDS[op[1]]
                struct.pack_into("<" + fmt, frame, offset, op[2])
            elif op[0] == "flip" and frame:
                frame[min(len(frame) - 1, int(op[1] * len(frame)))] ^= op[2]
            elif op[0] == "truncate":
                del frame[int(op[1] * len(frame)) :]
            elif op[0] == "extend":
                frame += op[1]
            elif op[0] == "shape" and len(frame) >= chunk_format.HEADER_SIZE:
                struct.pack_into("<B", frame, 24, len(op[1]))
                struct.pack_into(f"<{len(op[1])}I", frame, 28, *op[1])
        fields = {op[1] for op in mutations if op[0] == "field"}
        if seal and len(frame) >= chunk_format.HEADER_SIZE and "checksum" not in fields:
            if "payload_length" not in fields:
                struct.pack_into("<Q", frame, 56, len(frame) - chunk_format.HEADER_SIZE)
            chunk_format.seal_frame(frame)
        data = bytes(frame)
        expected = base_shape if with_expected else None
        shape = expected
        if not with_expected and len(data) >= chunk_format.HEADER_SIZE and data[24] <= 6:
            shape = struct.unpack_from(f"<{data[24]}I", data, 28)
        cost = measure_decode(
            lambda: serializer.loads(
                data, expected_shape=expected, expected_dtype=base_dtype if with_expected else None
            )
        )
        assert_bounded(cost, chunk_bytes=chunk_bytes, shape=shape, context=f"raw {mutations}")

    check()


def test_hostile_raw_frames_end_fast_in_a_chunk_error_or_the_right_shape() -> None:
    run_fresh(HERE, "200")


def test_a_raw_frame_over_max_chunk_bytes_is_corrupt() -> None:
    serializer = RawSerializer(EmptyConfig())
    frame = serializer.dumps(torch.zeros((4, 1024), dtype=torch.float32))
    assert serializer.max_chunk_bytes == chunk_format.DEFAULT_MAX_CHUNK_BYTES == 1 << 30
    assert serializer.loads(frame).shape == (4, 1024)
    serializer.max_chunk_bytes = 16 * 1024 - 1
    with pytest.raises(
        CorruptChunkError, match=r"16384 bytes, over the maximum chunk of 16383 bytes \(max_chunk_bytes\)"
    ):
        serializer.loads(frame)
    with pytest.raises(CorruptChunkError, match="max_chunk_bytes"):
        serializer.loads_trusted(frame)


def test_max_chunk_bytes_is_a_validated_setting() -> None:
    assert KVPlugConfig().max_chunk_bytes == 1 << 30
    assert load_config(engine_extra={"kvplug.max_chunk_bytes": "2GiB"}, env={}).config.max_chunk_bytes == 2 << 30
    for bad in (0, -1, "lots", 2 << 40):
        with pytest.raises(ConfigError, match="max_chunk_bytes"):
            load_config(engine_extra={"kvplug.max_chunk_bytes": bad}, env={})


def test_the_engine_bounds_its_serializer_and_refuses_a_bound_below_its_chunk() -> None:
    from core_helpers import LAYOUTS

    layout = LAYOUTS["vllm_flash"]  # a chunk of 8 tokens: 3 layers x K/V x 8 x 16 fp16 = 1536 bytes
    fingerprint = Fingerprint.for_layout(layout, model_id="m")

    def config(bound: int) -> KVPlugConfig:
        extra = {"kvplug.chunk_size": 8, "kvplug.store.queue.mode": "sync", "kvplug.max_chunk_bytes": bound}
        return load_config(engine_extra=extra, env={}).config

    with CacheEngine(config(1536), layout, fingerprint) as engine:
        assert engine.serializer.max_chunk_bytes == 1536
    with pytest.raises(ConfigError, match=r"max_chunk_bytes: a chunk of this model takes 1536 bytes"):
        CacheEngine(config(1535), layout, fingerprint)


def test_make_serializer_gives_every_adapter_the_configured_bound() -> None:
    """SGLang's HiCache storage built its serializer without the bound:
    adapters build theirs with ``make_serializer``, as ``CacheEngine`` does."""
    extra = {"kvplug.serializer": {"type": "raw"}, "kvplug.max_chunk_bytes": 4096}
    config = load_config(engine_extra=extra, env={}).config
    serializer = make_serializer(config, get_registry())
    assert isinstance(serializer, RawSerializer) and serializer.max_chunk_bytes == 4096
    frame = RawSerializer(EmptyConfig()).dumps(torch.zeros((2, 1025), dtype=torch.float16))
    with pytest.raises(CorruptChunkError, match="4100 bytes, over the maximum chunk of 4096 bytes"):
        serializer.loads(frame)


def test_an_empty_chunk_is_bounded_by_its_extent() -> None:
    """A zero dim made a frame 0 bytes whatever its other dims: (0, 2**32-1, 2**32-1, 2**32-1)
    passed every check and torch raised ``RuntimeError: Stride calculation overflowed``."""
    serializer = RawSerializer(EmptyConfig())
    frame = bytearray(serializer.dumps(torch.empty((4, 0), dtype=torch.float16)))
    assert serializer.loads(frame).shape == (4, 0)  # an empty chunk within the bound still decodes
    huge = 2**32 - 1
    frame[24] = 4  # ndim
    struct.pack_into("<4I", frame, 28, 0, huge, huge, huge)
    chunk_format.seal_frame(frame)
    for load in (serializer.loads, serializer.loads_trusted):
        with pytest.raises(
            CorruptChunkError,
            match=r"\(0, 4294967295, 4294967295, 4294967295\) and dtype float16 "
            r"spans \d+ bytes \(its dims, a zero counted as 1\), over the maximum chunk",
        ):
            load(bytes(frame))


if __name__ == "__main__":
    fuzz(int(sys.argv[1]))
