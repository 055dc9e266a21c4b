"""Tier ``disk`` as installed: found through its entry point and used by a CacheEngine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kvplug
from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config
from kvplug.errors import ConfigError
from kvplug_disk import DiskTier

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))

LAYOUT = KVLayout(VLLM_FLASH, num_layers=3, block_size=8, num_kv_heads=2, head_dim=4, dtype=torch.bfloat16)
NUM_BLOCKS = 16


def engine_on(path: Path) -> CacheEngine:
    config = load_config(
        engine_extra={
            "kvplug": {
                "chunk_size": 16,
                "store": {"queue": {"mode": "sync"}},
                "tiers": [{"type": "cpu"}, {"type": "disk", "path": str(path), "max_bytes": "64MiB"}],
            }
        },
        env={},
    ).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="test-model"))


def paged_caches() -> list[torch.Tensor]:
    return [torch.randn(2, NUM_BLOCKS, 8, 2, 4).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]


def kv_at(caches: list[torch.Tensor], slots: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's K and V of the tokens at ``slots`` (slot = block * block_size + offset)."""
    return [cache[:, slots // 8, slots % 8] for cache in caches]


def test_the_entry_point_provides_tier_disk() -> None:
    assert kvplug.get_registry().storage_tiers()["disk"] is DiskTier
    assert "kvplug-disk" in kvplug.get_registry().origin("storage_tier", "disk")


def test_config_errors_name_the_disk_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"tiers\[0\].*path"):
        load_config(engine_extra={"kvplug": {"tiers": [{"type": "disk"}]}}, env={})
    with pytest.raises(ConfigError, match="max_bytes"):
        load_config(
            engine_extra={"kvplug": {"tiers": [{"type": "disk", "path": str(tmp_path), "max_bytes": "lots"}]}}, env={}
        )


def test_a_second_engine_loads_kv_from_disk_and_promotes_it_to_cpu(tmp_path: Path) -> None:
    tokens = list(range(48))  # three whole chunks of 16
    source = paged_caches()
    slots = torch.randperm(NUM_BLOCKS * 8)[:48]
    with engine_on(tmp_path / "kv") as first:
        assert first.store(tokens, source, slots) == 48
        first.flush()
        assert first.lookup(tokens) == 48
    assert len(list((tmp_path / "kv").glob("*/*.kvr"))) == 4  # three chunks and the fingerprint manifest

    with engine_on(tmp_path / "kv") as second:
        cpu, disk = second.chain.tiers
        assert (cpu.stats().items, disk.stats().items) == (0, 4)  # and the fingerprint manifest
        assert second.lookup(tokens) == 48
        target = paged_caches()
        target_slots = torch.randperm(NUM_BLOCKS * 8)[:48]
        loaded = second.retrieve(tokens, target, target_slots)
        assert int(loaded.sum()) == 48
        for want, got in zip(kv_at(source, slots), kv_at(target, target_slots)):
            assert torch.equal(want, got)
        assert disk.stats().hits == 3
        assert cpu.stats().items == 3  # promoted
        again = paged_caches()
        assert int(second.retrieve(tokens, again, target_slots).sum()) == 48
        assert disk.stats().hits == 3 and cpu.stats().hits == 3  # now served by cpu
        for want, got in zip(kv_at(source, slots), kv_at(again, target_slots)):
            assert torch.equal(want, got)


def test_a_load_from_disk_checks_each_byte_once_by_the_record_checksum(tmp_path: Path, monkeypatch) -> None:
    """The record checksum covers the whole frame (``verified_reads``): the frame's own
    checksum is not computed again on load. A damaged record is still a miss."""
    from kvplug.core import chunk_format

    tokens = list(range(48))
    source = paged_caches()
    slots = torch.randperm(NUM_BLOCKS * 8)[:48]
    with engine_on(tmp_path / "kv") as first:
        assert first.store(tokens, source, slots) == 48
        first.flush()
    assert DiskTier.verified_reads

    frame_checksums: list[int] = []
    checksum = chunk_format.frame_checksum
    monkeypatch.setattr(chunk_format, "frame_checksum", lambda frame: frame_checksums.append(1) or checksum(frame))
    with engine_on(tmp_path / "kv") as second:
        target, target_slots = paged_caches(), torch.randperm(NUM_BLOCKS * 8)[:48]
        assert int(second.retrieve(tokens, target, target_slots).sum()) == 48
        assert second.chain.tiers[1].stats().hits == 3  # every chunk came from the disk
        assert frame_checksums == []
        for want, got in zip(kv_at(source, slots), kv_at(target, target_slots)):
            assert torch.equal(want, got)

    # a flipped byte in the middle of a record's value: that chunk and the rest are a miss
    records = sorted((tmp_path / "kv").glob("*/*.kvr"), key=lambda p: p.stat().st_size)
    damaged = records[-1]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x40
    damaged.write_bytes(bytes(data))
    with engine_on(tmp_path / "kv") as third:
        assert int(third.retrieve(tokens, paged_caches(), target_slots).sum()) < 48
        assert third.chain.tiers[1].stats().extra["corrupt"] == 1
