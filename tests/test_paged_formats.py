"""Engine layouts as data: PagedFormat declarations, the generic torch connector, and its
equivalence with kvplug 0.1's per-engine code (tests/reference_torch_connector.py)."""

from __future__ import annotations

from itertools import pairwise
from unittest import mock

import pytest
import torch
from core_helpers import FORMATS, SGLANG_MHA, VLLM_CPU, VLLM_FLASH, VLLM_MLA
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_torch_connector import ReferenceConnector

from kvplug import KVLayout, PagedFormat
from kvplug.builtins import index_runs
from kvplug.builtins.torch_connector import TorchConnector
from kvplug.core.components import EmptyConfig
from kvplug.errors import LayoutError
from kvplug.testing import gather_chunk, scatter_chunk

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn]
NUM_BLOCKS = 6
NUM_LAYERS = 2

# --- declarations --------------------------------------------------------------------------


def test_fingerprint_text_of_the_engine_formats() -> None:
    assert KVLayout(VLLM_FLASH, 32, 16, 8, 128, torch.bfloat16).describe() == "vllm_flash:L32:B16:H8:D128:bfloat16"
    assert (
        KVLayout(VLLM_MLA, 61, 64, 1, 576, torch.float8_e4m3fn).describe() == "vllm_mla:L61:B64:H1:D576:float8_e4m3fn"
    )
    # Packed chunks changed order in 0.2 (block order): the old ones must be misses, not misread.
    assert KVLayout(VLLM_CPU, 2, 32, 2, 64, torch.bfloat16).describe() == "vllm_cpu:L2:B32:H2:D64:bfloat16:block_order"
    assert KVLayout(SGLANG_MHA, 2, 1, 2, 8, torch.float32).describe() == "sglang_mha:L2:B1:H2:D8:float32"


def test_derived_facts_come_from_the_format() -> None:
    flash = KVLayout(VLLM_FLASH, 3, 4, 2, 8, torch.float16)
    assert (flash.num_kv, flash.whole_blocks_only, flash.page_tokens, flash.token_width) == (2, False, 4, 16)
    assert flash.chunk_shape(5) == (3, 2, 5, 16) and flash.bytes_per_token() == 3 * 2 * 16 * 2
    mla = KVLayout(VLLM_MLA, 2, 4, 1, 16, torch.bfloat16)
    assert (mla.num_kv, mla.chunk_shape(5)) == (1, (2, 1, 5, 16))
    cpu = KVLayout(VLLM_CPU, 2, 4, 2, 8, torch.bfloat16)
    assert cpu.whole_blocks_only and cpu.packed_block_split() == (2, 2, 4 * 8)  # per head: K half, V half
    with pytest.raises(LayoutError, match="vllm_flash is not a packed"):
        flash.packed_block_split()
    assert KVLayout(SGLANG_MHA, 2, 16, 2, 8, torch.float32).page_tokens == 1


def test_cache_shape_is_the_declared_axes_for_a_block_count() -> None:
    assert KVLayout(VLLM_FLASH, 3, 4, 2, 8, torch.float16).cache_shape(5) == (2, 5, 4, 2, 8)
    assert KVLayout(VLLM_MLA, 2, 4, 1, 16, torch.bfloat16).cache_shape(5) == (5, 4, 16)
    assert KVLayout(VLLM_CPU, 2, 4, 2, 8, torch.bfloat16).cache_shape(3) == (3, 2, 2, 4, 8)
    assert KVLayout(SGLANG_MHA, 2, 16, 2, 8, torch.float32).cache_shape(3) == (48, 2, 8)  # slots: blocks x block_size
    for fmt in FORMATS.values():
        layout = KVLayout(fmt, 2, 4, 1, 8, torch.float16)
        layer = torch.zeros(layout.cache_shape(3), dtype=torch.float16)
        layout.check_caches([layer if fmt.tensors == 1 else (layer,) * fmt.tensors] * 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"axes": ("kv", "block", "token", "heads", "dim")}, "unknown axis 'heads'"),
        ({"axes": ("kv", "block", "token", "dim", "dim")}, "twice"),
        ({"axes": ("kv", "block", "token", "head")}, "'dim' axis"),
        ({"axes": ("kv", "slot", "token", "head", "dim")}, "either slot"),
        ({"axes": ("kv", "block", "head", "dim")}, "'block' and 'token'"),
        ({"axes": ("kv", "slot", "head", "dim"), "tensors": 2}, "'kv' axis is wrong when K and V are separate"),
        ({"axes": ("slot", "head", "dim"), "tensors": 3}, "tensors is 1"),
        ({"axes": ("block", "token", "head", "dim")}, "need a 'kv' axis"),
        ({"axes": ("kv", "block", "token", "dim"), "latent": True}, "no K/V split"),
        ({"axes": ("slot", "dim"), "latent": True, "tensors": 2}, "latent cache is one tensor"),
        ({"axes": ("kv", "block", "token", "head", "dim"), "whole_blocks_only": True}, "'block' must be the first"),
        ({"axes": ("kv", "slot", "head", "dim"), "whole_blocks_only": True}, "'block' must be the first"),
    ],
)
def test_bad_formats_are_refused_with_the_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(LayoutError, match=message) as caught:
        PagedFormat("my_engine", **kwargs)
    assert "my_engine" in str(caught.value)


def test_layout_refuses_a_string_kind_and_extra_heads_of_a_latent_cache() -> None:
    with pytest.raises(LayoutError, match="PagedFormat"):
        KVLayout("vllm_flash", 2, 4, 2, 8, torch.float16)  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="num_kv_heads must be 1"):
        KVLayout(VLLM_MLA, 2, 4, 2, 8, torch.float16)


def test_check_caches_names_the_layer_the_format_and_the_shape() -> None:
    layout = KVLayout(VLLM_FLASH, 2, 4, 2, 8, torch.float16)
    good = torch.zeros(2, 5, 4, 2, 8, dtype=torch.float16)
    layout.check_caches([good, good])
    with pytest.raises(LayoutError, match=r"layer 1: shape \(2, 5, 4, 2, 7\) does not match vllm_flash"):
        layout.check_caches([good, torch.zeros(2, 5, 4, 2, 7, dtype=torch.float16)])
    with pytest.raises(LayoutError, match="layer 0: expected torch.float16"):
        layout.check_caches([good.float(), good])
    with pytest.raises(LayoutError, match="layer 0: a sglang_mha layer cache is 2 tensor"):
        KVLayout(SGLANG_MHA, 1, 1, 2, 8, torch.float16).check_caches([good])


def test_a_packed_format_takes_the_engines_nominal_shape_but_only_contiguous() -> None:
    layout = KVLayout(VLLM_CPU, 1, 4, 2, 8, torch.bfloat16)
    nominal = torch.zeros(3, 2, 4, 16, dtype=torch.bfloat16)  # vLLM CPU: [blocks, heads, block_size, 2 * head_dim]
    layout.check_caches([nominal])
    assert [tuple(v.shape) for v in layout.kv_views(nominal)] == [(3, 4, 2, 8), (3, 4, 2, 8)]
    with pytest.raises(LayoutError, match="vllm_cpu"):
        layout.check_caches([torch.zeros(3, 16, 2, 4, dtype=torch.bfloat16).transpose(1, 3)])
    with pytest.raises(LayoutError, match="vllm_cpu"):
        layout.check_caches([torch.zeros(6, 2, 4, 8, dtype=torch.bfloat16)])  # half a block per row


def test_kv_views_are_views_of_the_engines_memory() -> None:
    layout = KVLayout(VLLM_FLASH, 1, 4, 2, 8, torch.float32)
    cache = torch.zeros(2, 3, 4, 2, 8)
    k, v = layout.kv_views(cache)
    v[1, 2, 1, 3] = 7.0
    assert cache[1, 1, 2, 1, 3] == 7.0 and k.shape == (3, 4, 2, 8)
    sglang = KVLayout(SGLANG_MHA, 1, 16, 2, 8, torch.float32)
    k_buffer, v_buffer = torch.zeros(32, 2, 8), torch.zeros(32, 2, 8)
    k, v = sglang.kv_views((k_buffer, v_buffer))
    assert k.shape == (32, 1, 2, 8) and k.data_ptr() == k_buffer.data_ptr() and v.data_ptr() == v_buffer.data_ptr()


# --- bit-for-bit equivalence with kvplug 0.1's connector ---------------------------------


def random_bytes(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bits in ``dtype`` (NaN payloads and all: only a bit-exact copy matches)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=generator, dtype=torch.uint8)
    return raw.view(dtype)


def engine_caches(layout: KVLayout, storage: str, seed: int) -> tuple[list, list[torch.Tensor]]:
    """Per-layer caches as the engine allocates them, and the tensors that own their memory."""
    generator = torch.Generator().manual_seed(seed)
    b, h, d, nb = layout.block_size, layout.num_kv_heads, layout.head_dim, NUM_BLOCKS
    caches, owners = [], []
    for _ in range(layout.num_layers):
        if layout.format is SGLANG_MHA:
            pair = (
                random_bytes((nb * b, h, d), layout.dtype, generator),
                random_bytes((nb * b, h, d), layout.dtype, generator),
            )
            caches.append(pair)
            owners.extend(pair)
        elif layout.format is VLLM_MLA:
            caches.append(random_bytes((nb, b, d), layout.dtype, generator))
            owners.append(caches[-1])
        elif layout.format is VLLM_CPU:
            caches.append(random_bytes((nb, h, b, 2 * d), layout.dtype, generator))
            owners.append(caches[-1])
        elif storage == "sliced":  # a [2, nb, bs, H, D] view out of a bigger allocation
            owner = random_bytes((2, nb + 3, b, h, d), layout.dtype, generator)
            caches.append(owner[:, 1 : nb + 1])
            owners.append(owner)
        elif storage == "permuted":  # HND memory seen through an NHD view
            owner = random_bytes((2, nb, h, b, d), layout.dtype, generator)
            caches.append(owner.permute(0, 1, 3, 2, 4))
            owners.append(owner)
        else:
            caches.append(random_bytes((2, nb, b, h, d), layout.dtype, generator))
            owners.append(caches[-1])
    return caches, owners


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


VARIANTS = [
    ("vllm_flash", "contiguous"),
    ("vllm_flash", "sliced"),
    ("vllm_flash", "permuted"),
    ("vllm_mla", "contiguous"),
    ("vllm_cpu", "contiguous"),
    ("sglang_mha", "contiguous"),
]


#: Partial blocks only where the format allows them (vllm_cpu packs whole blocks).
CASES = [
    (name, storage, slot_kind)
    for name, storage in VARIANTS
    for slot_kind in ("whole_blocks", "partial")
    if slot_kind == "whole_blocks" or not FORMATS[name].whole_blocks_only
]


def in_runs(order: list[int], data: st.DataObject, label: str) -> list[int]:
    """``order`` cut into pieces that are each sorted: runs of consecutive values, as engines allocate."""
    cuts = sorted(data.draw(st.lists(st.integers(0, len(order)), max_size=3), label=label))
    bounds = [0, *cuts, len(order)]
    return [v for a, b in pairwise(bounds) for v in sorted(order[a:b])]


@pytest.mark.parametrize("copies", ["indexed", "sliced"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "storage", "slot_kind"), CASES, ids=["-".join(c) for c in CASES])
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_generic_connector_matches_the_01_connector_bit_for_bit(
    name: str, storage: str, dtype: torch.dtype, slot_kind: str, copies: str, data: st.DataObject
) -> None:
    # "sliced": every run of consecutive slots or blocks is copied as a slice, however
    # short, and the slots come mostly in runs; "indexed": the index kernels only.
    threshold = 0 if copies == "sliced" else 2**62
    with (
        mock.patch.object(index_runs, "MIN_MEAN_RUN_ROWS", threshold),
        mock.patch.object(index_runs, "MIN_MEAN_RUN_BYTES_WRITTEN", threshold),
    ):
        check_against_reference(name, storage, dtype, slot_kind, copies == "sliced", data)


def check_against_reference(
    name: str, storage: str, dtype: torch.dtype, slot_kind: str, runs: bool, data: st.DataObject
) -> None:
    fmt = FORMATS[name]
    # 0.1's vllm_cpu path needs block_size > 1 (it has no whole-block plan for blocks of one token)
    block = data.draw(st.sampled_from([2, 4] if fmt.whole_blocks_only else [1, 2, 4]), label="block_size")
    heads = 1 if fmt.latent else data.draw(st.integers(1, 3), label="heads")
    head_dim = data.draw(st.sampled_from([1, 3, 8]), label="head_dim")  # odd rows force narrow words
    layout = KVLayout(fmt, NUM_LAYERS, block, heads, head_dim, dtype)
    reference, generic = ReferenceConnector(EmptyConfig(), layout), TorchConnector(EmptyConfig(), layout)

    if slot_kind == "whole_blocks":
        blocks = data.draw(st.permutations(range(NUM_BLOCKS)), label="blocks")[: data.draw(st.integers(1, NUM_BLOCKS))]
        dst_blocks = data.draw(st.permutations(range(NUM_BLOCKS)), label="dst_blocks")[: len(blocks)]
        if runs:
            blocks, dst_blocks = in_runs(blocks, data, "block runs"), in_runs(dst_blocks, data, "dst block runs")
        src_slots = (torch.tensor(blocks)[:, None] * block + torch.arange(block)).reshape(-1)
        dst_slots = (torch.tensor(dst_blocks)[:, None] * block + torch.arange(block)).reshape(-1)
    else:
        slots = data.draw(st.permutations(range(NUM_BLOCKS * block)), label="slots")
        count = data.draw(st.integers(1, len(slots)), label="count")
        src, dst = slots[:count], data.draw(st.permutations(slots), label="dst")[:count]
        if runs:
            src, dst = in_runs(src, data, "runs"), in_runs(dst, data, "dst runs")
        src_slots, dst_slots = torch.tensor(src), torch.tensor(dst)

    seed = data.draw(st.integers(0, 2**16), label="seed")
    source, _ = engine_caches(layout, storage, seed)
    expected = torch.empty(layout.chunk_shape(src_slots.numel()), dtype=dtype)
    gather_chunk(reference, source, src_slots, expected)
    got = torch.full_like(as_bytes(expected), 0xA5).view(dtype)
    gather_chunk(generic, source, src_slots, got)
    if fmt.whole_blocks_only:  # 0.2 stores packed blocks in block order: heads outside tokens
        assert torch.equal(as_bytes(got), as_bytes(vllm_cpu_01_chunk_in_block_order(layout, expected)))
    else:
        assert torch.equal(as_bytes(got), as_bytes(expected))

    ref_target, ref_owners = engine_caches(layout, storage, seed + 1)
    new_target, new_owners = engine_caches(layout, storage, seed + 1)
    scatter_chunk(reference, ref_target, dst_slots, expected)
    scatter_chunk(generic, new_target, dst_slots, got)
    for want, have in zip(ref_owners, new_owners):  # the whole allocation: nothing written outside the view
        assert torch.equal(as_bytes(have), as_bytes(want))


@pytest.mark.parametrize("bad", [-1, -3, NUM_BLOCKS * 4])
def test_a_slot_outside_a_cache_no_fast_path_fits_is_refused_not_wrapped(bad: int) -> None:
    """Such a cache is copied with Python indexing, where slot -1 is the last page's last token:
    a store would keep another token's KV, a load would overwrite it."""
    layout = KVLayout(VLLM_FLASH, NUM_LAYERS, 4, 2, 8, torch.float16)
    connector = TorchConnector(EmptyConfig(), layout)
    caches, owners = engine_caches(layout, "permuted", 0)
    before = [owner.clone() for owner in owners]
    slots = torch.tensor([0, 1, bad, 3])
    chunk = torch.zeros(layout.chunk_shape(4), dtype=layout.dtype)
    with pytest.raises(LayoutError, match=rf"slot {bad} is outside the cache: it holds {NUM_BLOCKS * 4} slots"):
        gather_chunk(connector, caches, slots, chunk)
    with pytest.raises(LayoutError, match=rf"slot {bad} is outside the cache"):
        scatter_chunk(connector, caches, slots, chunk)
    assert all(torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(owners, before))


def vllm_cpu_01_chunk_in_block_order(layout: KVLayout, chunk: torch.Tensor) -> torch.Tensor:
    """0.1's vllm_cpu chunk (per K/V: [blocks, token, head, dim]) as 0.2 stores it: [blocks, head, token, dim]."""
    layers, num_kv, tokens, _ = chunk.shape
    heads, dim, size = layout.num_kv_heads, layout.head_dim, layout.block_size
    per_block = chunk.view(layers, num_kv, tokens // size, size, heads, dim)
    return per_block.transpose(3, 4).reshape(chunk.shape)


# --- a format the core has never heard of -------------------------------------------------

#: K and V of a block side by side per head: [num_blocks, num_heads, 2, block_size, head_dim].
HEAD_MAJOR = PagedFormat(
    "test_head_major", ("block", "head", "kv", "token", "dim"), shape_doc="[num_blocks, heads, 2, block_size, head_dim]"
)
#: K and V in separate tensors with a block axis: each [num_blocks, block_size, heads, head_dim].
SPLIT_BLOCKS = PagedFormat("test_split_blocks", ("block", "token", "head", "dim"), tensors=2)
#: One token-addressed pool, K and V interleaved per token: [num_slots, 2, heads, head_dim].
TOKEN_INTERLEAVED = PagedFormat("test_token_interleaved", ("slot", "kv", "head", "dim"))
#: Dims outermost, for a format no fast path fits: [head_dim, 2, heads, num_blocks, block_size].
DIM_MAJOR = PagedFormat("test_dim_major", ("dim", "kv", "head", "block", "token"))
NEW_FORMATS = [HEAD_MAJOR, SPLIT_BLOCKS, TOKEN_INTERLEAVED, DIM_MAJOR]


def allocate(layout: KVLayout, num_blocks: int, seed: int) -> list:
    """Caches shaped by the format's own axes, filled with random values."""
    generator = torch.Generator().manual_seed(seed)
    shape = layout.cache_shape(num_blocks)

    def fill() -> torch.Tensor:
        return torch.randn(shape, generator=generator).to(layout.dtype)

    return [
        tuple(fill() for _ in range(layout.format.tensors)) if layout.format.tensors > 1 else fill()
        for _ in range(layout.num_layers)
    ]


def token_kv(layout: KVLayout, layer_cache, slot: int) -> torch.Tensor:
    """``[num_kv, heads, head_dim]`` of one token, read off the axes without the connector."""
    order = ("kv", "block", "token", "slot", "head", "dim")
    tensors = layer_cache if isinstance(layer_cache, tuple) else (layer_cache,)
    rows = []
    for tensor in tensors:
        axes = layout.format.axes
        named = tensor.permute([axes.index(a) for a in order if a in axes])  # canonical axis order
        if "slot" in axes:
            token = named[..., slot, :, :] if "kv" in axes else named[slot]
        else:
            block, offset = divmod(slot, layout.block_size)
            token = named[:, block, offset] if "kv" in axes else named[block, offset]
        rows.append(token if "kv" in axes else token.unsqueeze(0))
    return torch.cat(rows)


@pytest.mark.parametrize("fmt", NEW_FORMATS, ids=lambda f: f.name)
def test_a_new_engine_format_round_trips_through_the_cache_engine(fmt: PagedFormat, make_engine) -> None:
    layout = KVLayout(fmt, num_layers=2, block_size=4, num_kv_heads=3, head_dim=8, dtype=torch.bfloat16)
    engine = make_engine(layout, connector={"type": "torch"})
    assert isinstance(engine.connector, TorchConnector)
    source, target = allocate(layout, 12, seed=1), allocate(layout, 12, seed=2)
    layout.check_caches(source)
    tokens = list(range(100, 124))
    src_slots = torch.arange(24) + 8  # blocks 2..7
    dst_slots = torch.cat([torch.arange(16, 24), torch.arange(40, 48), torch.tensor([1, 7, 3, 0, 2, 6, 4, 5])])
    assert engine.store(tokens, source, src_slots) == 24
    assert engine.lookup(tokens) == 24
    assert engine.retrieve(tokens, target, dst_slots).all()
    for src_cache, dst_cache in zip(source, target):
        for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
            assert torch.equal(token_kv(layout, src_cache, s), token_kv(layout, dst_cache, d))
    assert layout.describe().startswith(f"{fmt.name}:L2:B4:H3:D8:")


#: Packed formats of one and of two tensors per layer: whole blocks only.
PACKED = [
    PagedFormat("test_packed", ("block", "kv", "head", "token", "dim"), whole_blocks_only=True),
    PagedFormat("test_packed_split", ("block", "head", "token", "dim"), tensors=2, whole_blocks_only=True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("fmt", PACKED, ids=lambda f: f.name)
def test_a_new_packed_format_copies_whole_blocks(fmt: PagedFormat, dtype: torch.dtype) -> None:
    layout = KVLayout(fmt, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    connector = TorchConnector(EmptyConfig(), layout)
    source = [
        tuple(c.to(dtype) for c in cache) if isinstance(cache, tuple) else cache.to(dtype)
        for cache in allocate(KVLayout(fmt, 2, 4, 2, 8, torch.float32), 12, seed=3)
    ]
    target = [
        tuple(torch.zeros_like(t) for t in cache) if isinstance(cache, tuple) else torch.zeros_like(cache)
        for cache in source
    ]
    src_slots = (torch.tensor([5, 1, 9])[:, None] * 4 + torch.arange(4)).reshape(-1)
    dst_slots = (torch.tensor([0, 7, 2])[:, None] * 4 + torch.arange(4)).reshape(-1)
    chunk = torch.empty(layout.chunk_shape(12), dtype=dtype)
    gather_chunk(connector, source, src_slots, chunk)
    # The documented block order: chunk[layer, i, block b's tokens] is the b-th block's K/V part i, as stored.
    outer, kv, inner = layout.packed_block_split()
    for layer, cache in enumerate(source):
        tensors = cache if isinstance(cache, tuple) else (cache,)
        for b, block in enumerate([5, 1, 9]):
            for i in range(layout.num_kv):
                stored = tensors[i // kv][block].reshape(outer, kv, inner)[:, i % kv]
                copied = chunk[layer, i, b * 4 : (b + 1) * 4].reshape(outer, inner)
                assert torch.equal(copied.view(torch.uint8), stored.view(torch.uint8))
    scatter_chunk(connector, target, dst_slots, chunk)
    for src_cache, dst_cache in zip(source, target):
        for s, d in zip(src_slots.tolist(), dst_slots.tolist()):
            assert torch.equal(
                token_kv(layout, src_cache, s).view(torch.uint8), token_kv(layout, dst_cache, d).view(torch.uint8)
            )
    with pytest.raises(LayoutError, match=f"layout {fmt.name} packs tokens inside a block"):
        gather_chunk(connector, source, torch.tensor([4, 5, 6]), torch.empty(layout.chunk_shape(3), dtype=dtype))
