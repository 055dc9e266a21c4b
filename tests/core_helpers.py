"""Layouts, cache builders and an in-memory record backend shared by the core tests (imported
by name: a conftest is not importable once several test folders run in one pytest session)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, TypeVar

import torch

from kvplug import (
    Buffer,
    CacheEngine,
    CallSizes,
    Fingerprint,
    HeadShard,
    KVLayout,
    PagedFormat,
    RecordBackend,
    RecordToWrite,
    load_config,
)
from kvplug.core.plugins import PluginRegistry

#: The engine formats the adapters declare (kvplug_vllm's layout.py, kvplug_sglang's
#: setup_engine.py), copied here because the core tests run without those plugins.
#: Same names and axes, so fingerprints match.
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
VLLM_MLA = PagedFormat("vllm_mla", ("block", "token", "dim"), latent=True)
VLLM_CPU = PagedFormat("vllm_cpu", ("block", "head", "kv", "token", "dim"), whole_blocks_only=True)
SGLANG_MHA = PagedFormat("sglang_mha", ("slot", "head", "dim"), tensors=2)
FORMATS = {f.name: f for f in (VLLM_FLASH, VLLM_MLA, VLLM_CPU, SGLANG_MHA)}

#: One small layout per format, and how to make its per-layer caches.
LAYOUTS = {
    "vllm_flash": KVLayout(VLLM_FLASH, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16),
    "vllm_mla": KVLayout(VLLM_MLA, num_layers=2, block_size=4, num_kv_heads=1, head_dim=16, dtype=torch.bfloat16),
    "vllm_cpu": KVLayout(VLLM_CPU, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16),
    "sglang_mha": KVLayout(SGLANG_MHA, num_layers=2, block_size=1, num_kv_heads=2, head_dim=8, dtype=torch.float32),
}


#: The axis of each format's per-layer tensor that holds KV heads.
HEAD_AXIS = {"vllm_flash": 3, "vllm_cpu": 1, "sglang_mha": 1}


def heads_of(caches: list[Any], axis: int, first: int, count: int) -> list[Any]:
    """A rank's caches: the heads ``[first, first + count)`` of every layer, as separate tensors."""

    def cut(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(axis, first, count).contiguous()

    return [tuple(cut(t) for t in c) if isinstance(c, tuple) else cut(c) for c in caches]


def rank_shard(full: KVLayout, tp_rank: int, tp_size: int) -> tuple[HeadShard, KVLayout]:
    """The heads TP rank ``tp_rank`` of ``tp_size`` holds of ``full``'s, and its caches' layout
    (one head where the ranks outnumber the heads: replicated)."""
    heads = HeadShard.for_rank(total_heads=full.num_kv_heads, tp_rank=tp_rank, tp_size=tp_size)
    return heads, replace(full, num_kv_heads=max(1, full.num_kv_heads // tp_size))


def random_caches(layout: KVLayout, num_blocks: int, *, seed: int = 0) -> list:
    """Per-layer caches of ``layout`` filled with random values (any dtype)."""
    generator = torch.Generator().manual_seed(seed)
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim

    def fill(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(layout.dtype)

    caches = []
    for _ in range(layout.num_layers):
        if layout.format is VLLM_FLASH:
            caches.append(fill(2, num_blocks, b, h, d))
        elif layout.format is VLLM_MLA:
            caches.append(fill(num_blocks, b, d))
        elif layout.format is VLLM_CPU:
            caches.append(fill(num_blocks, h, b, 2 * d))
        else:
            caches.append((fill(num_blocks * b, h, d), fill(num_blocks * b, h, d)))
    return caches


def clone_caches(caches: list) -> list:
    return [tuple(t.clone() for t in c) if isinstance(c, tuple) else c.clone() for c in caches]


def caches_equal(a: list, b: list) -> bool:
    flat_a = [t for c in a for t in (c if isinstance(c, tuple) else (c,))]
    flat_b = [t for c in b for t in (c if isinstance(c, tuple) else (c,))]
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(flat_a, flat_b))


@contextmanager
def engine_maker(registry: PluginRegistry, tiers: list[dict[str, Any]], **settings: Any) -> Iterator[Any]:
    """``make(layout, heads)``: a CacheEngine of model ``m`` over ``tiers`` (or the ``tiers`` of
    that call; chunks of 8 tokens, stores written on the caller's side, ``settings`` on top), as
    each TP rank of an engine would open it; all of them closed on exit."""
    opened: list[CacheEngine] = []

    def make(layout: KVLayout, heads: HeadShard | None, *, tiers: list[dict[str, Any]] = tiers) -> CacheEngine:
        extra = {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers, **settings}
        config = load_config(engine_extra={"kvplug": extra}, env={}, registry=registry).config
        engine = CacheEngine(
            config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry, heads=heads
        )
        opened.append(engine)
        return engine

    try:
        yield make
    finally:
        for engine in opened:
            engine.close()


T = TypeVar("T")


class DictRecordBackend(RecordBackend):
    """Records in a dict of this process (``store``: pass one to share it between tiers), with
    only the primitives a backend must have: no ``listing`` (the tier indexes what it writes
    and reads, as over Mooncake) and no ``delete_if_same`` (a corrupt record stays).

    Faults a real server would cause: ``down`` fails every call as a dead server's would,
    ``failing`` names the store fails on alone (an exception in their slot). ``calls`` counts
    calls, ``deletes`` the names ``delete`` was asked to remove."""

    call_sizes = CallSizes(query=64, read=8, write=8, write_bytes=1 << 20)
    where = "a dict"

    def __init__(self, store: dict[str, bytes] | None = None) -> None:
        self.store: dict[str, bytes] = {} if store is None else store
        self.lock = threading.Lock()
        self.down = False
        self.calls = 0
        self.failing: set[str] = set()
        self.deletes: list[str] = []

    def _or_failed(self, name: str, answer: T) -> T | BaseException:
        return ConnectionError(f"the store failed on {name}") if name in self.failing else answer

    async def _enter(self) -> None:
        self.calls += 1
        if self.down:
            raise ConnectionError("store is down")
        await asyncio.sleep(0)

    async def sizes(self, names: Sequence[str]) -> list[int | None | BaseException]:
        await self._enter()
        with self.lock:
            return [self._or_failed(n, len(self.store[n]) if n in self.store else None) for n in names]

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | None | BaseException]:
        await self._enter()
        with self.lock:
            return [self._or_failed(n, self.store.get(n)) for n in names]

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        await self._enter()
        with self.lock:
            for record in records:
                self.store[record.name] = record.joined()
        return [None] * len(records)

    async def delete(self, names: Sequence[str]) -> list[bool | BaseException]:
        await self._enter()
        self.deletes.extend(names)
        with self.lock:
            return [
                self._or_failed(n, False) if n in self.failing else self.store.pop(n, None) is not None for n in names
            ]


class ComparingDictBackend(DictRecordBackend):
    """:class:`DictRecordBackend` that compares and deletes at once (``delete_if_same``)."""

    async def delete_if_same(self, names: Sequence[str], seen: Sequence[Buffer | None]) -> list[bool]:
        await self._enter()
        with self.lock:
            same = [data is not None and self.store.get(n) == bytes(data) for n, data in zip(names, seen)]
            return [ok and self.store.pop(n, None) is not None for n, ok in zip(names, same)]
