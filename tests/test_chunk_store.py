"""ChunkStore over real tiers (cpu, then disk): loads are verified before anything is
promoted into the faster, trusted cpu tier; a bad chunk is removed and ends the prefix."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvplug import ChunkStore, Fingerprint, KVPlugConfig, PluginRegistry, key_digest, load_config
from kvplug.errors import ConfigError

SHAPE = (2, 2, 8, 16)
DTYPE = torch.float16


@pytest.fixture
def registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu,disk")


def _config(registry: PluginRegistry, folder: Path, **settings: object) -> KVPlugConfig:
    tiers = [{"type": "cpu"}, {"type": "disk", "path": str(folder)}]
    return load_config(engine_extra={"kvplug": {"tiers": tiers, **settings}}, env={}, registry=registry).config


def _fingerprint(model_id: str = "m") -> Fingerprint:
    return Fingerprint(model_id=model_id, kv_layout="test", dtype="float16", block_size=8)


@pytest.fixture
def store(registry: PluginRegistry, tmp_path: Path) -> Iterator[ChunkStore]:
    with_store = ChunkStore.open(_config(registry, tmp_path / "disk"), _fingerprint(), registry=registry)
    yield with_store
    with_store.close()


def _chunks(store: ChunkStore, count: int, seed: int = 0) -> tuple[list[str], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    keys = [store.key_prefix + f"{seed:032x}{i:032x}" for i in range(count)]
    return keys, [torch.randn(SHAPE, generator=gen).to(DTYPE) for _ in range(count)]


def _stored_on_disk_only(store: ChunkStore, count: int) -> tuple[list[str], list[torch.Tensor]]:
    keys, tensors = _chunks(store, count)
    store.put_tensors(list(zip(keys, tensors)))
    store.flush()
    cpu, disk = store.chain.tiers
    cpu.remove(keys)  # as if evicted from memory: the next load reads the disk
    assert cpu.contains(keys) == [False] * count and disk.contains(keys) == [True] * count
    return keys, tensors


def test_chunks_from_the_slower_tier_are_verified_then_promoted(store: ChunkStore) -> None:
    keys, tensors = _stored_on_disk_only(store, 3)
    loaded = store.load_prefix(keys, [SHAPE] * 3, DTYPE)
    assert len(loaded.tensors) == 3 and all(torch.equal(a, b) for a, b in zip(loaded.tensors, tensors))
    assert loaded.nbytes > 3 * 2 * 2 * 8 * 16 * 2  # three frames, each more than its float16 payload
    cpu, _ = store.chain.tiers
    assert cpu.contains(keys) == [True, True, True]
    assert store.metrics.value("kvplug_promotions_total", tier="0:cpu") == 3
    assert store.metrics.value("kvplug_loaded_bytes_total") == loaded.nbytes


def test_a_corrupt_record_in_the_slower_tier_is_removed_and_never_promoted(store: ChunkStore, tmp_path: Path) -> None:
    """The disk tier checks each record's checksum over the whole frame (verified_reads):
    a flipped byte in a record file is a miss there, and the frame is not checksummed again.
    (A frame that fails its own checksum, from a tier without verified_reads: test_engine.py.)"""
    keys, tensors = _stored_on_disk_only(store, 3)
    cpu, disk = store.chain.tiers
    assert disk.verified_reads
    digest = key_digest(keys[1]).hex()
    (record,) = (tmp_path / "disk").glob(f"*/{digest}.kvr")
    damaged = bytearray(record.read_bytes())
    damaged[-3] ^= 0x10  # a payload byte of the frame inside the record
    record.write_bytes(bytes(damaged))

    loaded = store.load_prefix(keys, [SHAPE] * 3, DTYPE)
    assert len(loaded.tensors) == 1 and torch.equal(loaded.tensors[0], tensors[0])
    # Only the chunk before it went up. The bad record is gone, and the chunk after it
    # (never fetched: the prefix ended) stays where it was: not in the trusted tier.
    assert cpu.contains(keys) == [True, False, False]
    assert disk.contains(keys) == [True, False, True]
    assert disk.stats().extra["corrupt"] == 1
    assert store.metrics.value("kvplug_promotions_total", tier="0:cpu") == 1
    assert store.contains_prefix(keys) == 1


def test_a_frame_of_another_dtype_is_a_miss_removed_and_not_promoted(store: ChunkStore) -> None:
    keys, _ = _stored_on_disk_only(store, 2)
    cpu, disk = store.chain.tiers
    disk.remove([keys[0]])
    disk.put([(keys[0], store.serializer.dumps(torch.zeros(SHAPE, dtype=torch.bfloat16)))])
    assert store.load_prefix(keys, [SHAPE] * 2, DTYPE).tensors == []
    assert store.metrics.value("kvplug_load_errors_total", reason="IncompatibleChunkError") == 1
    store.flush()  # the removal is the chain's removal thread's work (the load does not wait for it)
    assert cpu.contains(keys) == [False, False] and disk.contains(keys) == [False, True]


def test_another_fingerprint_never_sees_the_chunks(registry: PluginRegistry, tmp_path: Path) -> None:
    config = _config(registry, tmp_path / "disk")
    writer = ChunkStore.open(config, _fingerprint(), registry=registry)
    reader = ChunkStore.open(config, _fingerprint("another-model"), registry=registry)
    try:
        keys, tensors = _chunks(writer, 2)
        writer.put_tensors(list(zip(keys, tensors)))
        writer.flush()
        assert reader.key_prefix != writer.key_prefix
        theirs = [reader.key_prefix + key.rsplit("/", 1)[1] for key in keys]  # the same chunks, its own keys
        assert reader.contains_prefix(theirs) == 0
        assert reader.load_prefix(theirs, [SHAPE] * 2, DTYPE).tensors == []
        assert writer.load_prefix(keys, [SHAPE] * 2, DTYPE).tensors[1].equal(tensors[1])
    finally:
        writer.close()
        reader.close()


def test_the_fingerprint_records_the_serializer_that_writes(store: ChunkStore) -> None:
    assert store.fingerprint.serializer == store.serializer.fingerprint() == "raw"
    other = Fingerprint(model_id="m", kv_layout="test", dtype="float16", block_size=8, serializer="zstd")
    with pytest.raises(ValueError, match="the fingerprint records serializer 'zstd', but frames are written by 'raw'"):
        ChunkStore(store.serializer, other, store.chain)


def test_a_chunk_over_max_chunk_bytes_is_a_config_error_before_tiers_open(
    registry: PluginRegistry, tmp_path: Path
) -> None:
    config = _config(registry, tmp_path / "disk", max_chunk_bytes=1024)
    with pytest.raises(ConfigError, match=r"max_chunk_bytes: a chunk of this model takes 1026 bytes"):
        ChunkStore.open(config, _fingerprint(), registry=registry, largest_chunk=((513,), DTYPE))
    assert not (tmp_path / "disk").exists()  # no tier was opened
    ChunkStore.open(config, _fingerprint(), registry=registry, largest_chunk=((512,), DTYPE)).close()
    assert (tmp_path / "disk").is_dir()
