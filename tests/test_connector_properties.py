"""gather -> scatter into a fresh cache writes exactly the chosen slots, for every layout."""

from __future__ import annotations

import pytest
import torch
from core_helpers import FORMATS, LAYOUTS, VLLM_CPU, VLLM_FLASH, VLLM_MLA, caches_equal, clone_caches, random_caches
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.builtins.index_runs import index_runs
from kvplug.builtins.torch_connector import TorchConnector
from kvplug.core.components import EmptyConfig
from kvplug.errors import LayoutError
from kvplug.testing import gather_chunk, scatter_chunk

NUM_BLOCKS = 12


def layer_tensors(cache) -> tuple[torch.Tensor, ...]:
    return cache if isinstance(cache, tuple) else (cache,)


def token_rows(layout, cache, slots: torch.Tensor) -> list[torch.Tensor]:
    """Each layer tensor's bytes at the given slots, read independently of the connector."""
    rows = []
    for tensor in layer_tensors(cache):
        raw = tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor
        if layout.format is VLLM_FLASH:
            rows.append(raw.flatten(1, 2)[:, slots])
        elif layout.format is VLLM_MLA:
            rows.append(raw.flatten(0, 1)[slots])
        elif layout.format is VLLM_CPU:
            rows.append(raw[torch.div(slots, layout.block_size, rounding_mode="floor")])
        else:
            rows.append(raw[slots])
    return rows


def slot_sets(layout_kind: str, count: int | None = None):
    """Unique slots in any order (whole blocks where the layout needs them); ``count`` units if given."""
    layout = LAYOUTS[layout_kind]
    size = layout.block_size
    units = NUM_BLOCKS if layout.whole_blocks_only else NUM_BLOCKS * size
    if count is None:
        chosen = st.lists(st.integers(0, units - 1), min_size=1, max_size=units, unique=True)
    else:  # built, not filtered: a filter on the size rejects most draws and trips hypothesis's health check
        chosen = st.permutations(range(units)).map(lambda order: order[:count])
    if layout.whole_blocks_only:
        return chosen.map(lambda b: (torch.tensor(b)[:, None] * size + torch.arange(size)).reshape(-1))
    return chosen.map(torch.tensor)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_gather_then_scatter_writes_exactly_those_slots(kind: str, data: st.DataObject) -> None:
    layout = LAYOUTS[kind]
    connector = TorchConnector(EmptyConfig(), layout)
    source = random_caches(layout, NUM_BLOCKS, seed=data.draw(st.integers(0, 99)))
    src_slots = data.draw(slot_sets(kind))
    # Destination slots: a permutation of other slots of the same count and shape.
    units = src_slots.numel() // (layout.block_size if layout.whole_blocks_only else 1)
    dst_slots = data.draw(slot_sets(kind, count=units))

    chunk = torch.empty(layout.chunk_shape(src_slots.numel()), dtype=layout.dtype)
    gather_chunk(connector, source, src_slots, chunk)
    target = random_caches(layout, NUM_BLOCKS, seed=1000)
    before = clone_caches(target)
    scatter_chunk(connector, target, dst_slots, chunk)

    for src_cache, dst_cache, old_cache in zip(source, target, before):
        for wanted, got in zip(token_rows(layout, src_cache, src_slots), token_rows(layout, dst_cache, dst_slots)):
            assert torch.equal(wanted.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8))
        untouched = torch.ones(NUM_BLOCKS * layout.block_size, dtype=torch.bool)
        untouched[dst_slots] = False
        if layout.whole_blocks_only:
            untouched = untouched.view(NUM_BLOCKS, -1).all(dim=1)
            keep = torch.nonzero(untouched).flatten() * layout.block_size
        else:
            keep = torch.nonzero(untouched).flatten()
        for old, new in zip(token_rows(layout, old_cache, keep), token_rows(layout, dst_cache, keep)):
            assert torch.equal(old.contiguous().view(torch.uint8), new.contiguous().view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_every_dtype_round_trips_through_a_paged_cache(dtype: torch.dtype) -> None:
    layout = LAYOUTS["vllm_flash"].__class__(VLLM_FLASH, 2, 4, 2, 8, dtype)
    connector = TorchConnector(EmptyConfig(), layout)
    itemsize = torch.empty((), dtype=dtype).element_size()
    source = [
        torch.randint(0, 256, (2, NUM_BLOCKS, 4, 2, 8 * itemsize), dtype=torch.uint8).view(dtype) for _ in range(2)
    ]
    slots = torch.tensor([5, 6, 7, 8, 30, 2])
    chunk = torch.empty(layout.chunk_shape(6), dtype=dtype)
    gather_chunk(connector, source, slots, chunk)
    target = [torch.zeros_like(c) for c in source]
    scatter_chunk(connector, target, slots, chunk)
    for s, t in zip(source, target):
        assert torch.equal(s.flatten(1, 2)[:, slots].view(torch.uint8), t.flatten(1, 2)[:, slots].view(torch.uint8))


def test_non_contiguous_flash_cache_takes_the_general_path() -> None:
    layout = LAYOUTS["vllm_flash"]
    connector = TorchConnector(EmptyConfig(), layout)
    # An HND-ordered allocation seen through an NHD view: same logical shape, other strides.
    base = torch.randn(2, NUM_BLOCKS, 2, 4, 8).to(layout.dtype)
    cache = base.permute(0, 1, 3, 2, 4)
    assert not cache.is_contiguous()
    slots = torch.tensor([0, 1, 2, 3, 9, 17])
    chunk = torch.empty(layout.chunk_shape(6), dtype=layout.dtype)
    connector.gather_layer(cache, connector.plan(slots), chunk[0])
    target = torch.zeros_like(base).permute(0, 1, 3, 2, 4)
    connector.scatter_layer(target, connector.plan(slots), chunk[0])
    assert torch.equal(cache.flatten(1, 2)[:, slots], target.flatten(1, 2)[:, slots])


def test_vllm_cpu_refuses_partial_blocks() -> None:
    layout = LAYOUTS["vllm_cpu"]
    connector = TorchConnector(EmptyConfig(), layout)
    caches = random_caches(layout, NUM_BLOCKS)
    chunk = torch.empty(layout.chunk_shape(3), dtype=layout.dtype)
    with pytest.raises(LayoutError, match="whole"):
        gather_chunk(connector, caches, torch.tensor([4, 5, 6]), chunk)


def test_caches_equal_helper_sees_differences() -> None:
    layout = LAYOUTS["sglang_mha"]
    a = random_caches(layout, 2)
    b = clone_caches(a)
    assert caches_equal(a, b)
    b[0][1][0, 0, 0] += 1
    assert not caches_equal(a, b)


@pytest.mark.parametrize("kind", ["vllm_flash", "vllm_mla", "sglang_mha"])
def test_large_rows_round_trip(kind: str) -> None:
    """Rows of 8 KiB and more (one vLLM block of K and V is 256 KiB here), in reverse order."""
    from kvplug import KVLayout

    heads = 1 if kind == "vllm_mla" else 8
    block = 1 if kind == "sglang_mha" else 16
    layout = KVLayout(
        FORMATS[kind], num_layers=2, block_size=block, num_kv_heads=heads, head_dim=512, dtype=torch.bfloat16
    )
    connector = TorchConnector(EmptyConfig(), layout)
    source = random_caches(layout, 8, seed=3)
    target = random_caches(layout, 8, seed=4)
    slots = (torch.tensor([5, 2, 7])[:, None] * block + torch.arange(block)).reshape(-1)
    chunk = torch.empty(layout.chunk_shape(slots.numel()), dtype=layout.dtype)
    gather_chunk(connector, source, slots, chunk)
    scatter_chunk(connector, target, slots.flip(0), chunk.flip(2))
    for src_cache, dst_cache in zip(source, target):
        for wanted, got in zip(token_rows(layout, src_cache, slots), token_rows(layout, dst_cache, slots)):
            assert torch.equal(wanted, got)


def random_bit_caches(layout, num_blocks: int, seed: int) -> list:
    """Caches of random bytes in ``layout.dtype``: NaN payloads and all, so only a bit-exact copy matches."""
    generator = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=layout.dtype).element_size()

    def fill(*shape: int) -> torch.Tensor:
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=generator, dtype=torch.uint8)
        return raw.view(layout.dtype)

    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    shapes = {
        "vllm_flash": (2, num_blocks, b, h, d),
        "vllm_mla": (num_blocks, b, d),
        "vllm_cpu": (num_blocks, h, b, 2 * d),
    }
    if layout.format.name == "sglang_mha":
        return [(fill(num_blocks * b, h, d), fill(num_blocks * b, h, d)) for _ in range(layout.num_layers)]
    return [fill(*shapes[layout.format.name]) for _ in range(layout.num_layers)]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("head_dim", [3, 8], ids=["odd_rows", "even_rows"])  # odd rows force narrow words
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_every_layout_and_dtype_round_trips_bit_exact(kind: str, dtype: torch.dtype, head_dim: int) -> None:
    from kvplug import KVLayout

    base = LAYOUTS[kind]
    layout = KVLayout(FORMATS[kind], 2, base.block_size, base.num_kv_heads, head_dim, dtype)
    connector = TorchConnector(EmptyConfig(), layout)
    source = random_bit_caches(layout, NUM_BLOCKS, seed=1)
    target = random_bit_caches(layout, NUM_BLOCKS, seed=2)
    size = layout.block_size
    slots = (torch.tensor([7, 2, 9])[:, None] * size + torch.arange(size)).reshape(-1)
    chunk = torch.empty(layout.chunk_shape(slots.numel()), dtype=dtype)
    gather_chunk(connector, source, slots, chunk)
    scatter_chunk(connector, target, slots, chunk)
    again = torch.empty_like(chunk)
    gather_chunk(connector, target, slots, again)
    assert torch.equal(as_bytes(again), as_bytes(chunk))
    for src_cache, dst_cache in zip(source, target):
        for wanted, got in zip(token_rows(layout, src_cache, slots), token_rows(layout, dst_cache, slots)):
            assert torch.equal(as_bytes(wanted), as_bytes(got))


def test_threads_sharing_a_connector_do_not_share_staging() -> None:
    """vllm_cpu stages blocks in scratch memory: per thread, or one thread's copy lands in another's cache."""
    import threading

    layout = LAYOUTS["vllm_cpu"]
    connector = TorchConnector(EmptyConfig(), layout)
    size = layout.block_size
    failures: list[str] = []

    def worker(seed: int) -> None:
        source = random_caches(layout, NUM_BLOCKS, seed=seed)
        for round_ in range(200):
            target = [torch.zeros_like(c) for c in source]
            blocks = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(seed * 1000 + round_))[:4]
            slots = (blocks[:, None] * size + torch.arange(size)).reshape(-1)
            chunk = torch.empty(layout.chunk_shape(slots.numel()), dtype=layout.dtype)
            gather_chunk(connector, source, slots, chunk)
            scatter_chunk(connector, target, slots, chunk)
            if not all(torch.equal(s[blocks], t[blocks]) for s, t in zip(source, target)):
                failures.append(f"thread {seed}, round {round_}")
                return

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in (1, 2, 3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures


def _expected_plan(layout, slots: list[int]) -> tuple[list[int] | None, object, object]:
    """What a plan of ``slots`` must say, worked out slot by slot: (whole blocks or None, slot runs, page runs)."""
    size = layout.block_size
    whole = (
        size > 1
        and len(slots) > 0
        and len(slots) % size == 0
        and all(s == slots[i - i % size] + i % size and slots[i - i % size] % size == 0 for i, s in enumerate(slots))
    )
    blocks = [s // size for s in slots[::size]] if whole else None
    runs_of_slots = index_runs(torch.tensor(slots, dtype=torch.long))
    if layout.page_tokens == 1:
        return blocks, runs_of_slots, runs_of_slots
    if blocks is not None:
        return blocks, None, index_runs(torch.tensor(blocks, dtype=torch.long))
    return None, runs_of_slots, None


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_plans_of_many_spans_are_the_plans_of_each_span(kind: str, data: st.DataObject) -> None:
    layout = LAYOUTS[kind]
    size = layout.block_size
    connector = TorchConnector(EmptyConfig(), layout)
    # Slot tensors as engines hand them out: whole blocks in order, now and then a stray slot.
    pieces = data.draw(
        st.lists(
            st.one_of(
                st.integers(0, NUM_BLOCKS - 1).map(lambda b: list(range(b * size, (b + 1) * size))),
                st.integers(0, NUM_BLOCKS * size - 1).map(lambda s: [s]),
            ),
            max_size=10,
        )
    )
    slots = [s for piece in pieces for s in piece]
    bound = st.integers(0, len(slots))
    spans = [tuple(sorted(pair)) for pair in data.draw(st.lists(st.tuples(bound, bound), max_size=5))]
    spans += [(start, start + size) for start in range(0, len(slots) - size + 1, size)]  # block-aligned chunks
    tensor = torch.tensor(slots, dtype=torch.long)

    plans = connector.plan_many(tensor, spans)

    assert len(plans) == len(spans)
    for (start, end), plan in zip(spans, plans):
        blocks, slot_runs, page_runs = _expected_plan(layout, slots[start:end])
        assert plan.slots.tolist() == slots[start:end]
        assert (None if plan.blocks is None else plan.blocks.tolist()) == blocks, (start, end)
        assert plan.block_offsets[0].tolist() == [s // size for s in slots[start:end]]
        assert plan.block_offsets[1].tolist() == [s % size for s in slots[start:end]]
        assert (plan.slot_runs, plan.page_runs) == (slot_runs, page_runs), (start, end)
        single = connector.plan(tensor[start:end])
        assert (single.slot_runs, single.page_runs) == (slot_runs, page_runs)
        assert (None if single.blocks is None else single.blocks.tolist()) == blocks
