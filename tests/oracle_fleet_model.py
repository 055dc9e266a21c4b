"""The model of the fleet in oracle_fleet.py: its configuration (``Cell``), a rank, and
what the shared tiers hold after the stores so far, with the engine's rules of what a store
writes and where a lookup and a load must end. Imported by name, as core_helpers is."""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    shared_max_bytes: int | None = None  # a budget: evictions, so no completeness check
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

    def __str__(self) -> str:
        return "-".join(f"{k}={v}" for k, v in vars(self).items())


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


def _label(start: int, count: int, total: int) -> str:
    return f"{start}-{start + count}/{total}"
