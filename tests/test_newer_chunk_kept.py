"""A chunk frame a later kvplug wrote, in a store shared during a rolling upgrade, is a miss to
this kvplug's loads and is kept for the engines that read it (as ``kvplug store gc`` keeps it,
and a record tier keeps a newer record version): only an unusable chunk is removed.

Real disk tier, real serializer; the newer frame is this kvplug's frame with its version raised.
"""

from __future__ import annotations

import struct
from pathlib import Path

import torch

from kvplug import ChunkStore, Fingerprint, load_config


def _store(folder: Path) -> ChunkStore:
    tiers = [{"type": "disk", "path": str(folder), "queue": {"mode": "sync"}}]
    config = load_config(engine_extra={"kvplug": {"tiers": tiers}}, env={}).config
    return ChunkStore.open(config, Fingerprint(model_id="m", dtype="float32", kv_layout="pages", block_size=4))


def test_a_load_keeps_a_newer_kvplugs_chunk_and_removes_a_corrupt_one(tmp_path: Path) -> None:
    store = _store(tmp_path / "disk")
    try:
        pages = [torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]
        keys = [store.key_prefix + f"{i:064x}" for i in range(2)]
        store.put_tensors(list(zip(keys, pages)))
        store.flush()
        (disk,) = store.chain.tiers
        newer, corrupt = (bytearray(value) for value in disk.get(keys))
        struct.pack_into("<H", newer, 4, 9)  # chunk frame version 9: from a later kvplug
        disk.put([(keys[0], bytes(newer)), (keys[1], bytes(corrupt[:-4]))])  # the other cut short
        store.flush()

        shapes = [(2, 4, 8)] * 2
        assert store.load_prefix(keys[:1], shapes[:1], torch.float32).tensors == []  # a miss
        assert store.load_prefix(keys[1:], shapes[1:], torch.float32).tensors == []
        store.flush()  # the removals of what the loads found unusable are done
        assert disk.contains(keys) == [True, False], "a load removed a newer kvplug's chunk"
    finally:
        store.close()
