"""The model of the fleet in oracle_fleet.py: its configuration (``Cell``) and the kvplug
config it gives each rank, a rank, and what the shared tiers hold after the stores so far
(which records, how many bytes, whether a budget or a quota can have evicted any), with the
engine's rules of what a store writes and where a lookup and a load must end. Imported by
name, as core_helpers is."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from core_helpers import LAYOUTS

from kvplug import CacheEngine, HeadShard, KVLayout
from kvplug.core.engine.tails import tail_cut, tail_lengths


@dataclass(frozen=True)
class Cell:
    """One configuration users run."""

    format: str
    heads: int = 2
    tps: tuple[int, ...] = (1,)
    heads_per_record: int | str = "auto"
    chunk: int = 8
    serializer: str = "raw"
    shared: tuple[str, ...] = ("disk",)
    save_unfull_chunk: bool = False
    block_granular_hits: bool = False
    queue: str = "sync"
    shared_max_bytes: int | None = None  # a budget: complete only while all stored fits in it
    #: Quotas on the shared tiers: (tenant 1's, by its name; the default: tenant 2's).
    quotas: tuple[str, str] | None = None
    tier_queue: str = "async"  # the shared tiers' own write queue (the disk tier's default: async)
    cpu_max_bytes: int | None = None  # each rank's cpu tier (None: room for a few chunks)
    connector: str = "torch"
    scrambled: bool = False  # caches as views of memory in another axis order

    def full_layout(self) -> KVLayout:
        return replace(LAYOUTS[self.format], num_kv_heads=1 if self.latent else self.heads)

    @property
    def latent(self) -> bool:
        return self.format == "vllm_mla"

    @property
    def lossy(self) -> bool:
        return self.serializer in ("int8", "fp8")

    def quota_bytes(self, tenant: int) -> int | None:
        """Tenant ``tenant``'s quota on the shared tiers (``None``: none; unsalted tenant 0 has none)."""
        if self.quotas is None or not tenant:
            return None
        quota = self.quotas[tenant - 1]
        if quota.endswith("%"):
            assert self.shared_max_bytes is not None, "a quota in percent needs shared_max_bytes"
            return int(self.shared_max_bytes * float(quota[:-1]) / 100)
        return int(quota)

    def __str__(self) -> str:
        return "-".join(f"{k}={v}" for k, v in vars(self).items())


#: The names of the salted tenants (tenant 1's salt is "tenant-1"): quotas name tenant 1 by its name.
TENANTS = {"alpha": "tenant-1", "beta": "tenant-2"}


def engine_config(cell: Cell, layout: KVLayout, folders: dict[str, Path]) -> dict[str, Any]:
    """The kvplug config of one rank of ``cell``: a small cpu tier of its own over the shared folders."""
    cpu = cell.cpu_max_bytes or 3 * (cell.chunk * layout.bytes_per_token() + 4096)
    tiers: list[dict[str, Any]] = [{"type": "cpu", "max_bytes": cpu, "pin_max_bytes": "90%"}]
    for kind in cell.shared:
        # on_full block: a write queue that drops a batch loses records the model counts as stored.
        tier: dict[str, Any] = {"type": kind, "path": str(folders[kind]), "queue": {"mode": cell.tier_queue}}
        if cell.tier_queue == "async":
            tier["queue"]["on_full"] = "block"
        if cell.shared_max_bytes is not None:
            tier["max_bytes"] = cell.shared_max_bytes
            tier["pin_max_bytes"] = "50%"
        if cell.quotas is not None:
            tier["quotas"] = {"alpha": cell.quotas[0], "default": cell.quotas[1]}
        tiers.append(tier)
    return {
        "chunk_size": cell.chunk,
        "save_unfull_chunk": cell.save_unfull_chunk,
        "block_granular_hits": cell.block_granular_hits,
        "serializer": {"type": cell.serializer},
        "connector": {"type": cell.connector},
        "store": {"queue": {"mode": cell.queue}},
        "tenancy": {"tenants": TENANTS},
        "tiers": tiers,
    }


@dataclass
class Rank:
    heads: HeadShard
    layout: KVLayout
    engine: CacheEngine


class SharedTiers:
    """What the shared tiers hold: per tenant and record label ("0-2/4"), the token prefixes
    whose record of those heads was stored; and from it, where a rank's loads must end."""

    def __init__(self, cell: Cell, full: KVLayout) -> None:
        self.cell = cell
        self.full = full
        self.stored: dict[tuple[int, str], set[tuple[int, ...]]] = {}

    def add(self, rank: Rank, tokens: list[int], ends: list[int], tenant: int) -> None:
        """``rank`` stored its records of the prefixes of ``tokens`` ending at ``ends``."""
        for label in self.labels(rank, rank.heads.group):
            self.stored.setdefault((tenant, label), set()).update(tuple(tokens[:e]) for e in ends)

    def labels(self, rank: Rank, group: int) -> list[str]:
        """The record labels of ``group`` heads per record covering ``rank``'s heads."""
        heads, held = rank.heads, rank.layout.num_kv_heads
        if group <= held:
            return [_label(heads.first + i * group, group, heads.total) for i in range(held // group)]
        start = heads.first // group * group
        return [_label(start, group, heads.total)]

    def splits(self, rank: Rank) -> list[list[str]]:
        """The splits of the heads ``rank`` reads, in the engine's order: its own, then others."""
        own = [self.labels(rank, rank.heads.group)]
        records = rank.engine.records
        return own + [self.labels(rank, other.group) for other in records.others]

    def bytes_stored(self, tenant: int | None = None) -> int | None:
        """The bytes of the record files of every record stored so far (of ``tenant``; ``None``:
        of all), evicted or not: the most a tier can have held. ``None`` where a record's size is
        not known beforehand (a compressing serializer)."""
        if self.cell.serializer != "raw":
            return None
        per_token = self.full.bytes_per_token() // (1 if self.cell.latent else self.cell.heads)
        total = 0
        for (owner, label), prefixes in self.stored.items():
            if tenant is None or owner == tenant:
                heads = int(label.split("/")[0].split("-")[1]) - int(label.split("-")[0])
                tokens = sum(len(p) - (len(p) - 1) // self.cell.chunk * self.cell.chunk for p in prefixes)
                total += MANIFEST_BYTES + len(prefixes) * RECORD_OVERHEAD + tokens * heads * per_token
        return total

    def keeps_all(self, tenant: int) -> bool:
        """Whether the shared tiers still hold every record ``tenant`` stored: none was ever
        evicted, as nothing stored so far (of any tenant) exceeds the tiers' budget and nothing
        of ``tenant``'s exceeds its quota (a tenant over its quota evicts its own records only)."""
        budget = self.cell.shared_max_bytes
        if budget is None:
            return True
        total, own, quota = self.bytes_stored(), self.bytes_stored(tenant), self.cell.quota_bytes(tenant)
        if total is None or own is None or total > budget:
            return False
        return quota is None or own <= quota

    def holds(self, labels: list[str], prefix: list[int], tenant: int) -> bool:
        return all(tuple(prefix) in self.stored.get((tenant, label), ()) for label in labels)

    def expected(self, rank: Rank, tokens: list[int], tenant: int, first: int = 0) -> int:
        """Where a load of ``tokens`` past token ``first`` must end, from what the shared tiers
        hold (the rules of retrieves, split_lookup and tails); ``first`` or less: nothing."""
        chunk, n = self.cell.chunk, len(tokens)
        every = [(start, min(start + chunk, n)) for start in range(0, n, chunk)]
        wanted = [(start, end) for start, end in every if end > first]
        keys = [(start, end) for start, end in wanted if self.copyable(max(start, first), end)]
        splits = self.splits(rank)

        def prefix(labels: list[str]) -> int:
            held = 0
            for _, end in keys:
                if not self.holds(labels, tokens[:end], tenant):
                    break
                held += 1
            return held

        chunks = prefix(splits[0])
        if not chunks and keys:  # another split's, where it holds the first chunk (as split_lookup)
            chunks = next((prefix(s) for s in splits[1:] if self.holds(s, tokens[: keys[0][1]], tenant)), 0)
        loaded = keys[chunks - 1][1] if chunks else first
        if self.cell.block_granular_hits and wanted[chunks:]:
            start, end = every[wanted[chunks][0] // chunk]
            for length in tail_lengths(start, end - start, self.full.block_size):
                if any(self.holds(s, tokens[: start + length], tenant) for s in splits):
                    if start + length > first and self.copyable(max(start, first), start + length):
                        loaded = start + length
                    break
        return loaded

    def copyable(self, start: int, end: int) -> bool:
        size = self.full.block_size
        return not self.full.whole_blocks_only or (start % size == 0 and end % size == 0)

    def stores(self, tokens: list[int]) -> list[int]:
        """The ends of the chunks a store of ``tokens`` writes (engine rules: stores.stored_keys)."""
        cell, n = self.cell, len(tokens)
        ends = [e for e in range(cell.chunk, n + 1, cell.chunk)]
        if cell.save_unfull_chunk and n % cell.chunk:
            ends.append(n)
        cut = tail_cut(n, cell.chunk, self.full.block_size) if cell.block_granular_hits else 0
        if cut and not (ends and ends[-1] == cut):
            ends.append(cut)
        return [e for e in ends if self.copyable(e - 1 - (e - 1) % cell.chunk, e)]


#: A record file's bytes beside its values: the disk tier's record header and the raw serializer's frame.
RECORD_OVERHEAD = 64 + 96
#: The most a record's manifest takes (one per writer of a tenant's records, ~470 bytes).
MANIFEST_BYTES = 512


def _label(start: int, count: int, total: int) -> str:
    return f"{start}-{start + count}/{total}"
