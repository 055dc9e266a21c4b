"""Serializer ``raw``: exact round trips, and specific errors for bad frames."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.builtins.raw_serializer import RawSerializer
from kvplug.core import chunk_format
from kvplug.core.components import EmptyConfig
from kvplug.errors import CorruptChunkError, IncompatibleChunkError

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn]


@pytest.fixture
def serializer() -> RawSerializer:
    return RawSerializer(EmptyConfig())


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    # Random bytes, not random floats: every bit pattern (NaNs, infs, -0.0) must survive.
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for d in shape:
        numel *= d
    raw = torch.randint(0, 256, (numel * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(0, 9), min_size=1, max_size=4), seed=st.integers(0, 1000))
def test_round_trip_is_bit_exact(dtype: torch.dtype, shape: list[int], seed: int) -> None:
    serializer = RawSerializer(EmptyConfig())
    tensor = random_tensor(tuple(shape), dtype, seed)
    data = serializer.dumps(tensor)
    back = serializer.loads(data, expected_shape=tuple(shape), expected_dtype=dtype)
    assert back.dtype == dtype and tuple(back.shape) == tuple(shape)
    assert torch.equal(back.view(torch.uint8), tensor.contiguous().view(torch.uint8))


def test_allocate_and_seal_write_in_place(serializer: RawSerializer) -> None:
    frame, payload = serializer.allocate((2, 3), torch.bfloat16)
    payload.copy_(torch.arange(6, dtype=torch.bfloat16).view(2, 3))
    back = serializer.loads(serializer.seal(frame))
    assert torch.equal(back, torch.arange(6, dtype=torch.bfloat16).view(2, 3))


def test_loads_is_zero_copy(serializer: RawSerializer) -> None:
    data = bytearray(serializer.dumps(torch.ones(1024)))
    back = serializer.loads(data)
    # The tensor's memory lies inside the buffer it was read from.
    base = torch.frombuffer(data, dtype=torch.uint8).data_ptr()
    assert base <= back.data_ptr() < base + len(data)


def _frame(serializer: RawSerializer) -> bytearray:
    return bytearray(serializer.dumps(random_tensor((4, 16), torch.float16)))


@pytest.mark.parametrize("offset", [0, 5, 9, 30, 60, 90, chunk_format.HEADER_SIZE, chunk_format.HEADER_SIZE + 77])
def test_any_flipped_byte_is_a_corrupt_or_incompatible_chunk(serializer: RawSerializer, offset: int) -> None:
    data = _frame(serializer)
    data[offset] ^= 0x40
    with pytest.raises((CorruptChunkError, IncompatibleChunkError)):
        serializer.loads(data)


def test_flipped_payload_byte_names_the_checksum(serializer: RawSerializer) -> None:
    data = _frame(serializer)
    data[-1] ^= 1
    with pytest.raises(CorruptChunkError, match="checksum"):
        serializer.loads(data)


@pytest.mark.parametrize("length", [0, 10, chunk_format.HEADER_SIZE, 150])
def test_truncated_frames_are_corrupt(serializer: RawSerializer, length: int) -> None:
    with pytest.raises(CorruptChunkError):
        serializer.loads(_frame(serializer)[:length])


def test_other_frame_version_is_incompatible(serializer: RawSerializer) -> None:
    data = _frame(serializer)
    struct.pack_into("<H", data, 4, 2)
    with pytest.raises(IncompatibleChunkError, match="version 2"):
        serializer.loads(data)


def test_unexpected_shape_or_dtype_is_incompatible(serializer: RawSerializer) -> None:
    data = serializer.dumps(torch.zeros(4, 16, dtype=torch.float16))
    with pytest.raises(IncompatibleChunkError, match="shape"):
        serializer.loads(data, expected_shape=(4, 8))
    with pytest.raises(IncompatibleChunkError, match="dtype"):
        serializer.loads(data, expected_dtype=torch.bfloat16)


def test_frames_are_plain_bytes_not_pickles(serializer: RawSerializer) -> None:
    data = bytes(serializer.dumps(torch.ones(3)))
    assert data[:4] == b"KVPL" and b"\x80\x04" not in data[:2]
    assert len(data) == chunk_format.HEADER_SIZE + 12
