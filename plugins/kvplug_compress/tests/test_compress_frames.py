"""Round trips, error bounds and the error contract of the zstd, lz4, int8 and fp8 serializers.

Every serializer x chunk dtype x layout, through both entry points (``dumps`` and the
engine's ``allocate`` + ``seal``). Lossless ones must give back every bit (random bit
patterns, NaNs included); lossy ones must stay within their documented bound.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvplug
from kvplug.errors import ChunkError, CorruptChunkError, IncompatibleChunkError
from kvplug.testing import KVSlots, LossyBound, assert_kv_matches
from kvplug_compress import FP8Serializer, Int8Serializer, LZ4Serializer, ZstdSerializer

LOSSLESS = {"zstd": ZstdSerializer, "lz4": LZ4Serializer}
LOSSY = {"int8": Int8Serializer, "fp8": FP8Serializer}
ALL = {**LOSSLESS, **LOSSY}
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
#: The engine formats as the vLLM/SGLang adapters declare them: chunks of each one's shape.
KINDS = [
    kvplug.PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim")),
    kvplug.PagedFormat("vllm_mla", ("block", "token", "dim"), latent=True),
    kvplug.PagedFormat("vllm_cpu", ("block", "head", "kv", "token", "dim"), whole_blocks_only=True),
    kvplug.PagedFormat("sglang_mha", ("slot", "head", "dim"), tensors=2),
]
#: Half an ulp, relative, of rounding a float32 result to the chunk dtype.
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}

# Small segments make even test-sized chunks span several segments, so the threaded path runs.
OPTIONS = {"zstd": {"segment_bytes": 4096, "threads": 3}, "lz4": {"segment_bytes": 4096, "threads": 3}}


def make(name: str, **options: object) -> kvplug.Serializer:
    cls = ALL[name]
    return cls(cls.Config(**{**OPTIONS.get(name, {}), **options}))


@st.composite
def chunks(draw: st.DrawFn, dtype: torch.dtype) -> torch.Tensor:
    """A chunk tensor shaped like one of a random layout: [layers, K/V, tokens, heads * head_dim]."""
    kind = draw(st.sampled_from(KINDS))
    heads = 1 if kind.latent else draw(st.integers(1, 4))
    layout = kvplug.KVLayout(
        kind,
        num_layers=draw(st.integers(1, 3)),
        block_size=draw(st.sampled_from([1, 4, 16])),
        num_kv_heads=heads,
        head_dim=draw(st.sampled_from([8, 16, 64, 80, 128])),
        dtype=dtype,
    )
    shape = layout.chunk_shape(draw(st.integers(0, 40)))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    values = torch.randn(shape, generator=generator) * draw(st.sampled_from([1e-3, 1.0, 30.0]))
    if values.numel() and draw(st.booleans()):  # outlier channels, as real K has
        channels = torch.randint(0, shape[-1], (max(1, shape[-1] // 32),), generator=generator)
        values[..., channels] *= 50
    if dtype == torch.float8_e4m3fn:
        values = values.clamp(-448, 448)
    return values.to(dtype)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Any bit pattern at all (NaNs, infs, subnormals): what a lossless codec must keep."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (math.prod(shape) * itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).view(shape)


def through_allocate(serializer: kvplug.Serializer, tensor: torch.Tensor) -> memoryview:
    frame, payload = serializer.allocate(tuple(tensor.shape), tensor.dtype)
    # The engine sizes its store queue by the unsealed frames' bytes.
    assert memoryview(frame).nbytes == tensor.numel() * tensor.element_size()
    payload.copy_(tensor)
    return serializer.seal(frame)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LOSSLESS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_lossless_round_trip_is_bit_exact(name: str, dtype: torch.dtype, data: st.DataObject) -> None:
    serializer = make(
        name, level=data.draw(st.sampled_from([0, 1, 3]) if name == "lz4" else st.sampled_from([-1, 1, 3]))
    )
    tensor = data.draw(chunks(dtype))
    if data.draw(st.booleans()):
        tensor = random_bits(tuple(tensor.shape), dtype, data.draw(st.integers(0, 2**31)))
    for frame in (serializer.dumps(tensor), through_allocate(serializer, tensor)):
        loaded = serializer.loads(frame, expected_shape=tuple(tensor.shape), expected_dtype=dtype)
        assert loaded.dtype == dtype and tuple(loaded.shape) == tuple(tensor.shape)
        assert torch.equal(bits(loaded), bits(tensor))


def test_lossless_shrinks_bf16_kv_by_its_exponent_plane() -> None:
    # Values of similar magnitude share their exponent byte: that plane compresses, the mantissa barely.
    tensor = torch.randn(4, 2, 256, 512, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    # lz4 has no entropy coder, so it only gains where bytes repeat: less than zstd.
    for name, most in (("zstd", 0.75), ("lz4", 0.95)):
        frame = make(name).dumps(tensor)
        assert len(frame) < most * tensor.numel() * 2, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", LOSSY)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_lossy_round_trip_stays_within_the_documented_bound(name: str, dtype: torch.dtype, data: st.DataObject) -> None:
    group = data.draw(st.sampled_from([8, 16, 64, 100]))
    serializer = make(name, group_size=group)
    tensor = data.draw(chunks(dtype))
    for frame in (serializer.dumps(tensor), through_allocate(serializer, tensor)):
        loaded = serializer.loads(frame, expected_shape=tuple(tensor.shape), expected_dtype=dtype)
        assert loaded.dtype == dtype and tuple(loaded.shape) == tuple(tensor.shape)
        if dtype == torch.float8_e4m3fn:  # an fp8 cache is stored as it is
            assert torch.equal(bits(loaded), bits(tensor))
            continue
        assert_within_bound(name, tensor, loaded, group)


def assert_within_bound(name: str, tensor: torch.Tensor, loaded: torch.Tensor, group: int) -> None:
    width = tensor.shape[-1]
    if tensor.numel() == 0:
        return
    x = tensor.float().reshape(-1, width)
    groups = math.ceil(width / group)
    padded = torch.nn.functional.pad(x.abs(), (0, groups * group - width)).view(x.shape[0], groups, group)
    # The stored scale is amax / code_max rounded up to fp16: at most 2**-10 above it.
    code_max = 127.0 if name == "int8" else 448.0
    scale = (padded.amax(-1) / code_max * (1 + 2.0**-10)).repeat_interleave(group, dim=1)[:, :width]
    bound = scale / 2 if name == "int8" else torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    # float32 arithmetic adds a few ulps; the chunk dtype's rounding up to half an ulp (x2 for slack).
    rounding = ROUNDING[tensor.dtype] * 2
    # (absolute below the dtype's normal range: fp16 subnormals are 2**-24 apart)
    bound = bound * (1 + 1e-5) + x.abs() * (rounding + 2.0**-20) + torch.finfo(tensor.dtype).tiny * rounding + 1e-30
    error = (loaded.float().reshape(-1, width) - x).abs()
    worst = (error / bound).max().item()
    assert worst <= 1.0, f"{name}: error {worst:.3f}x the bound"


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_halves_bf16_chunks(name: str) -> None:
    tensor = torch.randn(2, 2, 64, 512).to(torch.bfloat16)
    frame = make(name).dumps(tensor)
    assert tensor.numel() * 2 / len(frame) >= 1.9


@pytest.mark.parametrize("name", LOSSY)
def test_lossy_keeps_inf_and_nan_exact(name: str) -> None:
    tensor = torch.randn(1, 2, 4, 64).to(torch.bfloat16)
    tensor[0, 0, 1, 3] = float("inf")
    tensor[0, 1, 2, 5] = float("nan")
    loaded = make(name).loads(make(name).dumps(tensor))
    assert torch.equal(bits(loaded), bits(tensor))


def test_lossy_large_magnitudes_use_fp32_scales() -> None:
    tensor = torch.full((1, 1, 2, 64), 1e20, dtype=torch.float32)
    tensor[0, 0, 1] = -3e30
    for name in LOSSY:
        loaded = make(name).loads(make(name).dumps(tensor))
        assert torch.isfinite(loaded).all(), name
        assert torch.allclose(loaded, tensor, rtol=0.07), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("name", LOSSY)
def test_lossy_values_at_the_dtypes_largest_stay_finite(name: str, dtype: torch.dtype) -> None:
    # The scale is rounded up: code_max times it passes fp16's 65504, which a plain cast makes inf.
    tensor = torch.randn(1, 2, 4, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    largest = torch.finfo(dtype).max
    tensor[0, 0, 0, 0], tensor[0, 1, 1, 7] = largest, -largest
    tensor[0, 0, 2, :] = torch.linspace(-largest, largest, 64, dtype=torch.float64).to(dtype)
    loaded = make(name).loads(make(name).dumps(tensor))
    assert bool(torch.isfinite(loaded).all()), f"{name} {dtype}: a finite value decoded as inf"
    assert_within_bound(name, tensor, loaded, 64)


# --- the error contract ----------------------------------------------------------------------


def sample(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.randn(2, 2, 16, 64, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=25, deadline=None)
@given(where=st.floats(0, 1, exclude_max=True), mask=st.integers(1, 255))
def test_any_flipped_bit_is_a_chunk_error_never_wrong_data(name: str, where: float, mask: int) -> None:
    serializer = make(name)
    frame = bytearray(serializer.dumps(sample()))
    offset = int(where * len(frame))
    frame[offset] ^= mask
    # The version/header-length fields (bytes 4..7) read as another format; anything else is corrupt.
    expected = ChunkError if 4 <= offset < 8 or offset < 4 else CorruptChunkError
    with pytest.raises(expected):
        serializer.loads(bytes(frame))


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("keep", [0, 10, 95, 96, 97, -1])
def test_truncated_or_extended_frames_are_corrupt(name: str, keep: int) -> None:
    serializer = make(name)
    frame = bytes(serializer.dumps(sample()))
    with pytest.raises(CorruptChunkError):
        serializer.loads(frame[:keep])
    with pytest.raises(CorruptChunkError):
        serializer.loads(frame + b"\0")


@pytest.mark.parametrize("writer", ALL)
@pytest.mark.parametrize("reader", [*ALL, "raw"])
def test_a_frame_is_only_read_by_the_serializer_that_wrote_it(writer: str, reader: str) -> None:
    if writer == reader:
        return
    serializers = kvplug.get_registry().serializers()
    read = serializers[reader](serializers[reader].Config())
    with pytest.raises(ChunkError):
        read.loads(make(writer).dumps(sample()))
    if reader != "raw":
        with pytest.raises(IncompatibleChunkError, match="written by serializer"):
            read.loads(make(writer).dumps(sample()))


@pytest.mark.parametrize("name", ALL)
def test_a_raw_frame_is_incompatible(name: str) -> None:
    raw_cls = kvplug.get_registry().serializers()["raw"]
    with pytest.raises(IncompatibleChunkError, match="'raw'"):
        make(name).loads(raw_cls(raw_cls.Config()).dumps(sample()))


@pytest.mark.parametrize("name", ALL)
def test_expected_shape_and_dtype_are_checked(name: str) -> None:
    serializer = make(name)
    frame = serializer.dumps(sample())
    with pytest.raises(IncompatibleChunkError, match="shape"):
        serializer.loads(frame, expected_shape=(2, 2, 8, 64))
    with pytest.raises(IncompatibleChunkError, match="dtype"):
        serializer.loads(frame, expected_dtype=torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", LOSSY)
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31), magnitude=st.sampled_from([1e-6, 6e-5, 1e-3, 1.0]))
def test_the_kv_oracle_accepts_what_a_lossy_codec_decodes(
    name: str, dtype: torch.dtype, seed: int, magnitude: float
) -> None:
    # Small values reach fp16's subnormals, 2**-24 apart whatever their size: the oracle's
    # bound must allow that rounding, as the codec's documented bound does.
    generator = torch.Generator().manual_seed(seed)
    chunk = torch.randn(1, 2, 16, 128, generator=generator) * magnitude  # [layers, K/V, tokens, 2 heads * 64]
    chunk[0, :, 3] *= torch.logspace(-6, 0, 128)
    chunk = chunk.to(dtype)
    loaded = make(name, group_size=16).loads(make(name, group_size=16).dumps(chunk))
    as_slots = [
        KVSlots(0, 0, 0, 1, ("K", "V"), [t.view(2, 16, 2, 64)], torch.ones(16, dtype=torch.bool))
        for t in (loaded, chunk)
    ]
    assert_kv_matches(as_slots[:1], as_slots[1:], 16, bound=LossyBound(name, 16))  # type: ignore[arg-type]


@pytest.mark.parametrize("name", LOSSLESS)
def test_close_ends_the_serializers_threads(name: str) -> None:
    """A closed engine closes its serializer: a codec's thread pool must not outlive it."""
    serializer = make(name)  # 4 KiB segments on 3 threads
    tensor = random_bits((2, 2, 64, 128), torch.bfloat16, 5)
    before = set(threading.enumerate())
    assert torch.equal(bits(serializer.loads(serializer.dumps(tensor))), bits(tensor))
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith(f"kvplug-{name}")]
    assert started
    serializer.close()
    assert not [t.name for t in started if t.is_alive()]
    # Used again (a frame decoded after close), it still decodes.
    assert torch.equal(bits(serializer.loads(serializer.dumps(tensor))), bits(tensor))
    serializer.close()


def test_a_serializer_name_longer_than_the_codec_field_is_refused() -> None:
    """The frame header keeps 8 bytes of the name: a longer one was cut on write, so every
    frame the serializer wrote was refused on read as another serializer's (all misses)."""

    class LongName(ZstdSerializer):
        name = "zstd_dictionary"

    with pytest.raises(ValueError, match="'zstd_dictionary' must be ASCII of at most 8 characters"):
        LongName(LongName.Config())
