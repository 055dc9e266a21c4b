"""The compressing serializers in a real CacheEngine over a real disk tier.

Stores go through the engine's fast path (frame pool, ``allocate`` + ``seal`` on the
store thread), loads through ``loads``; the key fingerprint carries the serializer's
name and its byte-changing options, so no engine ever reads another's chunks.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import kvplug
from kvplug.errors import ConfigError

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = kvplug.PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))

LAYOUT = kvplug.KVLayout(VLLM_FLASH, num_layers=3, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
NUM_BLOCKS = 64
TOKENS = list(range(100, 132))  # 4 chunks of 8


def caches(seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return [torch.randn(shape, generator=generator).to(LAYOUT.dtype) for _ in range(LAYOUT.num_layers)]


def engine(path: Path, serializer: dict[str, Any], **extra: Any) -> kvplug.CacheEngine:
    settings = {"chunk_size": 8, "serializer": serializer, "tiers": [{"type": "disk", "path": str(path)}], **extra}
    config = kvplug.load_config(engine_extra={"kvplug": settings}, env={}).config
    return kvplug.CacheEngine(config, LAYOUT, kvplug.Fingerprint.for_layout(LAYOUT, model_id="m"))


def slots(blocks: range) -> torch.Tensor:
    return kvplug.slots_from_block_ids(list(blocks), LAYOUT.block_size, len(TOKENS))


def store(path: Path, serializer: dict[str, Any], source: list[torch.Tensor]) -> None:
    with engine(path, serializer) as writer:
        assert writer.store(TOKENS, source, slots(range(8))) == len(TOKENS)
        writer.flush()


def retrieve(path: Path, serializer: dict[str, Any]) -> tuple[int, list[torch.Tensor]]:
    target = caches(seed=9)
    with engine(path, serializer) as reader:
        hit = reader.lookup(TOKENS)
        loaded = reader.retrieve(TOKENS, target, slots(range(8, 16)))
        assert int(loaded.sum()) == hit
    return hit, target


def blocks_of(cache_list: list[torch.Tensor], blocks: range) -> torch.Tensor:
    return torch.stack([c[:, blocks.start : blocks.stop] for c in cache_list]).float()


@pytest.mark.parametrize("serializer", [{"type": "zstd"}, {"type": "lz4", "level": 4}])
def test_lossless_chunks_come_back_bit_exact_from_disk(tmp_path: Path, serializer: dict[str, Any]) -> None:
    source = caches(seed=1)
    store(tmp_path, serializer, source)
    hit, target = retrieve(tmp_path, serializer)
    assert hit == len(TOKENS)
    expected = torch.stack([c[:, 0:8] for c in source])
    assert torch.equal(torch.stack([c[:, 8:16] for c in target]).view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("serializer", [{"type": "int8"}, {"type": "fp8", "group_size": 16}])
def test_lossy_chunks_come_back_close_from_disk(tmp_path: Path, serializer: dict[str, Any]) -> None:
    source = caches(seed=1)
    store(tmp_path, serializer, source)
    hit, target = retrieve(tmp_path, serializer)
    assert hit == len(TOKENS)
    expected, got = blocks_of(source, range(8)), blocks_of(target, range(8, 16))
    relative = ((got - expected).norm() / expected.norm()).item()
    assert 0 < relative < (0.01 if serializer["type"] == "int8" else 0.05)


def test_frames_are_smaller_on_disk(tmp_path: Path) -> None:
    sizes = {}
    for name in ("raw", "zstd", "int8"):
        store(tmp_path / name, {"type": name}, caches(seed=1))
        sizes[name] = sum(p.stat().st_size for p in (tmp_path / name).rglob("*") if p.is_file())
    assert sizes["int8"] < 0.6 * sizes["raw"]
    assert sizes["zstd"] < sizes["raw"]


# Chunks stored by zstd level 1 (the first entry) and looked up by each of these engines.
OTHERS = [
    {"type": "raw"},
    {"type": "lz4"},
    {"type": "int8"},
    {"type": "fp8"},
    {"type": "zstd", "level": 3},  # options that change the stored bytes change the key
    {"type": "zstd", "segment_bytes": 8192},
]


def test_another_serializer_or_option_never_sees_the_chunks(tmp_path: Path) -> None:
    store(tmp_path, {"type": "zstd", "level": 1}, caches(seed=1))
    for serializer in OTHERS:
        hit, target = retrieve(tmp_path, serializer)
        assert hit == 0, serializer
        assert torch.equal(target[0], caches(seed=9)[0]), serializer
    # Thread counts do not change the bytes: same fingerprint, the chunks are found.
    hit, _ = retrieve(tmp_path, {"type": "zstd", "level": 1, "threads": 1})
    assert hit == len(TOKENS)


def test_lossy_group_size_is_part_of_the_key(tmp_path: Path) -> None:
    store(tmp_path, {"type": "int8", "group_size": 32}, caches(seed=1))
    assert retrieve(tmp_path, {"type": "int8", "group_size": 16})[0] == 0
    assert retrieve(tmp_path, {"type": "int8", "group_size": 32})[0] == len(TOKENS)


def test_a_corrupt_chunk_on_disk_ends_the_prefix(tmp_path: Path) -> None:
    source = caches(seed=1)
    store(tmp_path, {"type": "zstd"}, source)
    with engine(tmp_path, {"type": "zstd"}) as reader:
        keys = [k.key for k in reader.chunk_keys(TOKENS)]
    victim = _record_of(tmp_path, keys[1])
    data = bytearray(victim.read_bytes())
    data[-20] ^= 0x5A  # inside the compressed planes of the second chunk
    victim.write_bytes(bytes(data))
    target = caches(seed=9)
    with engine(tmp_path, {"type": "zstd"}) as reader:
        loaded = reader.retrieve(TOKENS, target, slots(range(8, 16)))
    assert loaded.tolist() == [True] * 8 + [False] * 24  # the first chunk only, never damaged data
    assert torch.equal(torch.stack([c[:, 8:10] for c in target]), torch.stack([c[:, 0:2] for c in source]))
    assert torch.equal(torch.stack([c[:, 10:16] for c in target]), torch.stack([c[:, 10:16] for c in caches(seed=9)]))


def _record_of(path: Path, key: str) -> Path:
    import hashlib

    digest = hashlib.sha256(key.encode()).hexdigest()
    matches = [p for p in path.rglob("*") if p.is_file() and digest in p.name]
    assert len(matches) == 1, (key, [p.name for p in path.rglob("*")][:5])
    return matches[0]


@pytest.mark.parametrize(
    ("serializer", "message"),
    [
        ({"type": "zstd", "level": 40}, "level"),
        ({"type": "lz4", "level": -1}, "level"),
        ({"type": "int8", "group_size": 3}, "group_size"),
        ({"type": "fp8", "groupsize": 64}, "groupsize"),
        ({"type": "zstd", "threads": 0}, "threads"),
    ],
)
def test_bad_options_name_the_field(serializer: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config = kvplug.load_config(engine_extra={"kvplug": {"serializer": serializer}}, env={}).config
        config.resolve()


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_a_closed_chunk_store_leaves_no_codec_thread(tmp_path: Path, name: str) -> None:
    """The store made the serializer, so closing it ends the codec's thread pool (a closed
    engine kept referenced, as an adapter keeps its connector, held those threads)."""
    settings = {"serializer": {"type": name, "segment_bytes": 4096, "threads": 3}, "tiers": [{"type": "cpu"}]}
    config = kvplug.load_config(engine_extra={"kvplug": settings}, env={}).config
    store = kvplug.ChunkStore.open(config, kvplug.Fingerprint.for_layout(LAYOUT, model_id="m"))
    before = set(threading.enumerate())
    chunk = torch.randn(LAYOUT.chunk_shape(256), generator=torch.Generator().manual_seed(4)).to(LAYOUT.dtype)
    store.put_tensors([(store.key_prefix + "ab" * 16, chunk)])
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith(f"kvplug-{name}")]
    assert started
    store.close()
    assert not [t.name for t in started if t.is_alive()]


@pytest.mark.parametrize("name", ["zstd", "lz4"])
def test_a_closed_engine_leaves_no_codec_thread(tmp_path: Path, name: str) -> None:
    """``CacheEngine.close`` closes its chunk store, and so the serializer the store made."""
    serializer = {"type": name, "segment_bytes": 4096, "threads": 3}
    before = set(threading.enumerate())
    writer = engine(tmp_path, serializer, chunk_size=256)
    tokens = list(range(256))
    assert writer.store(tokens, caches(seed=1), kvplug.slots_from_block_ids(list(range(64)), 4, 256)) == 256
    writer.flush()
    started = [t for t in set(threading.enumerate()) - before if t.name.startswith(f"kvplug-{name}")]
    assert started
    writer.close()
    assert not [t.name for t in started if t.is_alive()]
