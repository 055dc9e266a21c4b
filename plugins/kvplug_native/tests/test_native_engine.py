"""The ``native`` connector inside a ``kvplug.CacheEngine``: the caches it leaves are the torch connector's."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import pytest
import torch
from native_helpers import FLASH, HND, MLA, PACKED, SLOTS_KV, UNWRITTEN, Caches, make_caches, torch_connector, unwritten

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config, slots_from_block_ids
from kvplug.errors import ConfigError
from kvplug.testing import gather_chunk
from kvplug_native import NativeConnector

CHUNK = 16
LAYOUTS = {
    "flash": KVLayout(FLASH, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
    "hnd": KVLayout(HND, num_layers=3, block_size=8, num_kv_heads=2, head_dim=16, dtype=torch.float16),
    "mla": KVLayout(MLA, num_layers=2, block_size=4, num_kv_heads=1, head_dim=24, dtype=torch.float8_e4m3fn),
    "packed": KVLayout(PACKED, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
    "slots_kv": KVLayout(SLOTS_KV, num_layers=2, block_size=1, num_kv_heads=2, head_dim=8, dtype=torch.float32),
}
NUM_BLOCKS = {"flash": 24, "hnd": 12, "mla": 24, "packed": 24, "slots_kv": 96}
TOKENS = list(range(500, 540))  # two whole chunks and a partial one, which is not stored


def make_engine(layout: KVLayout, connector: dict[str, Any], chunk_size: int = CHUNK) -> CacheEngine:
    config = load_config(
        engine_extra={
            "kvplug": {
                "chunk_size": chunk_size,
                "store": {"queue": {"mode": "sync"}},
                "copy_threads": 2,
                "connector": connector,
                "tiers": [{"type": "cpu", "max_bytes": "64MiB"}],
            }
        },
        env={},
    ).config
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id=f"native-tests/{connector['type']}"))


@contextmanager
def engines(layout: KVLayout) -> Iterator[tuple[CacheEngine, CacheEngine]]:
    """A native engine (streaming stores always on) and a torch engine, each with its own cpu tier."""
    with ExitStack() as stack:
        mine = stack.enter_context(make_engine(layout, {"type": "native", "streaming_min_bytes": 0}))
        theirs = stack.enter_context(make_engine(layout, {"type": "torch"}))
        assert isinstance(mine.connector, NativeConnector) and mine.connector.options.streaming_min_bytes == 0
        assert theirs.connector.name == "torch"
        yield mine, theirs


def _slots(kind: str, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots of the prompt in the source cache (blocks shuffled) and others to load it into."""
    order = torch.randperm(NUM_BLOCKS[kind], generator=torch.Generator().manual_seed(1)).tolist()
    needed = -(-len(TOKENS) // layout.block_size)
    # Loads go to consecutive blocks (their runs merge), stores come from shuffled ones.
    store_blocks = order[:needed]
    load_blocks = sorted(order[needed : 2 * needed])
    return (
        slots_from_block_ids(store_blocks, layout.block_size, len(TOKENS)),
        slots_from_block_ids(load_blocks, layout.block_size, len(TOKENS)),
    )


def _fresh(source: Caches) -> Caches:
    return source.clone(fill=lambda base: unwritten(torch.empty_like(base)))


def _at_slots(layout: KVLayout, caches: Caches, slots: torch.Tensor) -> torch.Tensor:
    """What the reference connector gathers from ``slots``: the KV stored at them, as bytes."""
    chunk = torch.empty(layout.chunk_shape(slots.numel()), dtype=layout.dtype)
    gather_chunk(torch_connector(layout), caches.layers, slots, chunk)
    return chunk.view(torch.uint8)


def _layer_bases(layout: KVLayout, caches: Caches, layer: int) -> list[torch.Tensor]:
    tensors = layout.format.tensors
    return caches.bases[layer * tensors : (layer + 1) * tensors]


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_store_and_retrieve_leave_the_torch_engines_caches(kind: str) -> None:
    layout = LAYOUTS[kind]
    source = make_caches(layout, NUM_BLOCKS[kind], torch.Generator().manual_seed(2))
    store_slots, load_slots = _slots(kind, layout)
    with engines(layout) as (mine, theirs):
        assert mine.store(TOKENS, source.layers, store_slots) == 32
        assert theirs.store(TOKENS, source.layers, store_slots) == 32
        assert mine.lookup(TOKENS) == 32

        got, want = _fresh(source), _fresh(source)
        loaded = mine.retrieve(TOKENS, got.layers, load_slots)
        assert torch.equal(loaded, theirs.retrieve(TOKENS, want.layers, load_slots))
        assert int(loaded.sum()) == 32 and bool(loaded[:32].all())

    assert got.same_bytes(want)
    # The loaded slots hold what the stored ones held; the partial chunk's slots and the rest are untouched.
    assert torch.equal(_at_slots(layout, got, load_slots[:32]), _at_slots(layout, source, store_slots[:32]))
    assert bool((_at_slots(layout, got, load_slots[32:]) == UNWRITTEN).all())


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_layerwise_store_and_retrieve(kind: str) -> None:
    layout = LAYOUTS[kind]
    source = make_caches(layout, NUM_BLOCKS[kind], torch.Generator().manual_seed(3))
    store_slots, load_slots = _slots(kind, layout)
    with engines(layout) as (mine, theirs):
        storing = mine.store_layerwise(TOKENS, source.layers, store_slots)
        assert list(storing) == list(range(layout.num_layers))
        assert theirs.store(TOKENS, source.layers, store_slots) == 32

        got, want = _fresh(source), _fresh(source)
        assert int(theirs.retrieve(TOKENS, want.layers, load_slots).sum()) == 32
        fresh = _fresh(source)
        loading = mine.retrieve_layerwise(TOKENS, got.layers, load_slots)
        assert loading.num_loaded_tokens == 32
        for step, layer in enumerate(loading):
            assert layer == step
            for other in range(layout.num_layers):  # layers up to this one written, later ones not yet
                expected = want if other <= layer else fresh
                for a, b in zip(_layer_bases(layout, got, other), _layer_bases(layout, expected, other)):
                    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (layer, other)
    assert got.same_bytes(want)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("first", [5, 21, 31])
def test_a_retrieve_with_a_mask_writes_only_after_its_false_prefix(kind: str, first: int) -> None:
    """A mask whose False prefix ends inside a chunk (and a block): only the rest is written, as with torch."""
    layout = LAYOUTS[kind]
    source = make_caches(layout, NUM_BLOCKS[kind], torch.Generator().manual_seed(4))
    store_slots, load_slots = _slots(kind, layout)
    mask = torch.arange(len(TOKENS)) >= first
    with engines(layout) as (mine, theirs):
        assert mine.store(TOKENS, source.layers, store_slots) == 32
        assert theirs.store(TOKENS, source.layers, store_slots) == 32
        got, want = _fresh(source), _fresh(source)
        loaded = mine.retrieve(TOKENS, got.layers, load_slots, mask)
        assert torch.equal(loaded, theirs.retrieve(TOKENS, want.layers, load_slots, mask))

    assert got.same_bytes(want)
    # Packed formats load whole blocks only: from the first block boundary at or after the prefix.
    start = -(-first // layout.block_size) * layout.block_size if layout.whole_blocks_only else first
    assert torch.equal(loaded, (torch.arange(len(TOKENS)) >= start) & (torch.arange(len(TOKENS)) < 32))
    if start < 32:
        assert torch.equal(
            _at_slots(layout, got, load_slots[start:32]), _at_slots(layout, source, store_slots[start:32])
        )
    else:
        assert not bool(loaded.any())
    if start:
        assert bool((_at_slots(layout, got, load_slots[:start]) == UNWRITTEN).all())


def test_a_larger_chunk_size_and_many_chunks() -> None:
    """Chunks of 32 tokens, a prompt of several hundred, loaded into a second cache at other slots."""
    layout = KVLayout(FLASH, num_layers=4, block_size=16, num_kv_heads=4, head_dim=32, dtype=torch.bfloat16)
    source = make_caches(layout, 80, torch.Generator().manual_seed(5))
    tokens = list(range(1, 641))
    order = torch.randperm(80, generator=torch.Generator().manual_seed(6)).tolist()
    store_slots = slots_from_block_ids(order[:40], 16, 640)
    load_slots = slots_from_block_ids(order[40:], 16, 640)
    with (
        make_engine(layout, {"type": "native"}, chunk_size=32) as mine,
        make_engine(layout, {"type": "torch"}, chunk_size=32) as theirs,
    ):
        assert mine.store(tokens, source.layers, store_slots) == 640
        assert theirs.store(tokens, source.layers, store_slots) == 640
        got, want = _fresh(source), _fresh(source)
        assert int(mine.retrieve(tokens, got.layers, load_slots).sum()) == 640
        assert int(theirs.retrieve(tokens, want.layers, load_slots).sum()) == 640
    assert got.same_bytes(want)
    assert torch.equal(_at_slots(layout, got, load_slots), _at_slots(layout, source, store_slots))


def test_auto_picks_native() -> None:
    layout = LAYOUTS["flash"]
    with make_engine(layout, {"type": "auto"}) as engine:
        assert engine.connector.name == "native"
        assert isinstance(engine.connector, NativeConnector)


def test_connector_options_are_checked() -> None:
    layout = LAYOUTS["flash"]
    with make_engine(layout, {"type": "native", "streaming_min_bytes": "4MiB"}) as engine:
        assert engine.connector.options.streaming_min_bytes == 4 * 2**20
    with make_engine(layout, {"type": "native", "streaming_min_bytes": None}) as engine:
        assert engine.connector.options.streaming_min_bytes is None
    with pytest.raises(ConfigError, match="streaming_min_byte"):
        make_engine(layout, {"type": "native", "streaming_min_byte": 0})
