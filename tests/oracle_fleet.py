"""The fleet state machine of test_engine_oracle_cells.py: engines of several TP sizes over
shared tiers, each load checked against the KV oracle (tests/kv_oracle.py); a test sets its
``CELL``, the configuration. Imported by name, as core_helpers is."""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from core_helpers import LAYOUTS
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from kv_oracle import block_slots, empty_caches, flat, prefix_kv, token_mask, write_tokens

from kvplug import CacheEngine, Fingerprint, HeadShard, KVLayout, RequestInfo, load_config
from kvplug.core.engine.locations import hit_tokens
from kvplug.core.engine.tails import tail_cut, tail_lengths
from kvplug.core.plugins import PluginRegistry

BASE = list(range(1000, 1040))
#: Prompts sharing prefixes of 16, 8, 24, 12 and 6 tokens with the first one.
PROMPTS = [
    BASE,
    BASE[:16] + list(range(2000, 2024)),
    BASE[:8] + list(range(3000, 3032)),
    BASE[:24] + list(range(4000, 4016)),
    BASE[:12] + list(range(5000, 5028)),
    BASE[:6] + list(range(6000, 6034)),
]
MAX_TOKENS = 40
#: What a store or a load of one of the PROMPTS draws: the engine, the prompt and its length,
#: the block table's seed, the tenant, and the tokens already in the cache (masked).
PROMPT_DRAWS = {
    "which": st.integers(0, 3),
    "prompt": st.integers(0, len(PROMPTS) - 1),
    "length": st.integers(1, MAX_TOKENS),
    "blocks": st.integers(0, 2**32),
    "tenant": st.integers(0, 2),
    "skip": st.integers(0, MAX_TOKENS),
}


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


class Fleet(RuleBasedStateMachine):
    """Engines of ``CELL.tps`` TP sizes over shared tiers, checked by the KV oracle."""

    CELL: Cell

    def __init__(self) -> None:
        super().__init__()
        cell = self.CELL
        self.full = cell.full_layout()
        self.num_blocks = -(-MAX_TOKENS // self.full.block_size) + 2
        self.folders = {
            kind: Path(tempfile.mkdtemp(prefix=f"kvplug-oracle-{kind}-", dir=_root(kind))) for kind in cell.shared
        }
        self.registry = PluginRegistry(plugin_filter="cpu,disk,compress,native")
        self.groups = [self._open(tp) for tp in cell.tps]
        #: Per record label ("0-2/4"): the token prefixes whose record of those heads a shared tier holds.
        self.stored: dict[str, set[tuple[int, ...]]] = {}
        self.corrupted = 0
        self.unflushed = False  # a store not waited for: what loads find is not known
        self.asked: list[tuple[int, int, int]] = []  # (prompt, length, tenant) of every store
        #: Per engine, the prompts each of its ranks pinned whole (none refused or missing).
        self.pinned: list[set[tuple[int, int, int]]] = [set() for _ in cell.tps]

    # --- engines -------------------------------------------------------------------

    def _open(self, tp: int) -> list[Rank]:
        cell = self.CELL
        ranks = []
        for rank in range(tp):
            if cell.latent:
                heads = HeadShard.for_rank(total_heads=1, tp_rank=rank, tp_size=tp, latent=True)
                layout = self.full
            else:
                heads = HeadShard.for_rank(
                    total_heads=cell.heads, tp_rank=rank, tp_size=tp, heads_per_record=cell.heads_per_record
                )
                layout = replace(self.full, num_kv_heads=max(1, cell.heads // tp))
            ranks.append(Rank(heads, layout, self._engine(layout, heads)))
        return ranks

    def _engine(self, layout: KVLayout, heads: HeadShard) -> CacheEngine:
        cell = self.CELL
        record = cell.chunk * layout.bytes_per_token() + 4096
        tiers: list[dict[str, Any]] = [{"type": "cpu", "max_bytes": 3 * record, "pin_max_bytes": "90%"}]
        for kind in cell.shared:
            tier: dict[str, Any] = {"type": kind, "path": str(self.folders[kind])}
            if cell.shared_max_bytes is not None:
                tier["max_bytes"] = cell.shared_max_bytes
                tier["pin_max_bytes"] = "50%"
            tiers.append(tier)
        extra = {
            "chunk_size": cell.chunk,
            "save_unfull_chunk": cell.save_unfull_chunk,
            "block_granular_hits": cell.block_granular_hits,
            "serializer": {"type": cell.serializer},
            "connector": {"type": cell.connector},
            "store": {"queue": {"mode": cell.queue}},
            "tiers": tiers,
        }
        config = load_config(engine_extra={"kvplug": extra}, env={}, registry=self.registry).config
        return CacheEngine(
            config, layout, Fingerprint.for_layout(layout, model_id="oracle"), registry=self.registry, heads=heads
        )

    def _close(self, group: list[Rank]) -> None:
        for rank in group:
            rank.engine.close()

    # --- the model of what the shared tiers hold --------------------------------------

    def _labels(self, rank: Rank, group: int) -> list[str]:
        """The record labels of ``group`` heads per record covering ``rank``'s heads."""
        heads, held = rank.heads, rank.layout.num_kv_heads
        if group <= held:
            return [_label(heads.first + i * group, group, heads.total) for i in range(held // group)]
        start = heads.first // group * group
        return [_label(start, group, heads.total)]

    def _splits(self, rank: Rank) -> list[list[str]]:
        """The splits of the heads ``rank`` reads, in the engine's order: its own, then others."""
        own = [self._labels(rank, rank.heads.group)]
        records = rank.engine.records
        return own + [self._labels(rank, other.group) for other in records.others]

    def _held(self, labels: list[str], prefix: list[int], tenant: int) -> bool:
        return all(tuple(prefix) in self.stored.get((tenant, label), ()) for label in labels)

    def _expected(self, rank: Rank, tokens: list[int], tenant: int, first: int = 0) -> int:
        """Where a load of ``tokens`` past token ``first`` must end, from what the shared tiers
        hold (the rules of retrieves, split_lookup and tails); ``first`` or less: nothing."""
        chunk, n = self.CELL.chunk, len(tokens)
        every = [(start, min(start + chunk, n)) for start in range(0, n, chunk)]
        wanted = [(start, end) for start, end in every if end > first]
        keys = [(start, end) for start, end in wanted if self._copyable(max(start, first), end)]
        splits = self._splits(rank)

        def prefix(labels: list[str]) -> int:
            held = 0
            for _, end in keys:
                if not self._held(labels, tokens[:end], tenant):
                    break
                held += 1
            return held

        chunks = prefix(splits[0])
        if not chunks and keys:  # another split's, where it holds the first chunk (as split_lookup)
            chunks = next((prefix(s) for s in splits[1:] if self._held(s, tokens[: keys[0][1]], tenant)), 0)
        loaded = keys[chunks - 1][1] if chunks else first
        if self.CELL.block_granular_hits and wanted[chunks:]:
            start, end = every[wanted[chunks][0] // chunk]
            for length in tail_lengths(start, end - start, self.full.block_size):
                if any(self._held(s, tokens[: start + length], tenant) for s in splits):
                    if start + length > first and self._copyable(max(start, first), start + length):
                        loaded = start + length
                    break
        return loaded

    def _copyable(self, start: int, end: int) -> bool:
        size = self.full.block_size
        return not self.full.whole_blocks_only or (start % size == 0 and end % size == 0)

    def _stores(self, tokens: list[int]) -> list[int]:
        """The ends of the chunks a store of ``tokens`` writes (engine rules: stores.stored_keys)."""
        cell, n = self.CELL, len(tokens)
        ends = [e for e in range(cell.chunk, n + 1, cell.chunk)]
        if cell.save_unfull_chunk and n % cell.chunk:
            ends.append(n)
        cut = tail_cut(n, cell.chunk, self.full.block_size) if cell.block_granular_hits else 0
        if cut and not (ends and ends[-1] == cut):
            ends.append(cut)
        return [e for e in ends if self._copyable(e - 1 - (e - 1) % cell.chunk, e)]

    # --- rules ----------------------------------------------------------------------

    @rule(which=st.integers(0, 3))
    def restart(self, which: int) -> None:
        """New processes of one engine on the same folders: empty cpu tiers, indexes rebuilt."""
        index = which % len(self.groups)
        self._close(self.groups[index])
        self.groups[index] = self._open(self.CELL.tps[index])
        self.pinned[index].clear()  # pins live in the process that made them

    @rule()
    def flush(self) -> None:
        """Wait for every store so far (a restart drains its engine's queue too)."""
        for group in self.groups:
            for rank in group:
                rank.engine.flush()
        self.unflushed = False

    @precondition(lambda self: bool(self.asked))
    @rule(which=st.integers(0, 3), pick=st.integers(0, 10**6), unpin=st.booleans())
    def pin(self, which: int, pick: int, unpin: bool) -> None:
        """Every rank of an engine pins (or unpins) a prompt stored before."""
        index = which % len(self.groups)
        prompt, length, tenant = asked = self.asked[pick % len(self.asked)]
        tokens, request = PROMPTS[prompt][:length], _request(tenant)
        if unpin:
            for rank in self.groups[index]:
                rank.engine.unpin(tokens, request=request)
            self.pinned[index].discard(asked)
            return
        reports = [rank.engine.pin(tokens, request=request) for rank in self.groups[index]]
        if all(r.chunks and not (r.refused or r.missing or r.book_full) for r in reports):
            self.pinned[index].add(asked)

    @rule(**PROMPT_DRAWS, wait=st.integers(0, 3))
    def store(self, which: int, prompt: int, length: int, blocks: int, tenant: int, skip: int, wait: int) -> None:
        """Every rank of an engine stores a prompt (``skip`` tokens of it stored before: masked)."""
        group = self.groups[which % len(self.groups)]
        tokens = PROMPTS[prompt][:length]
        table = random.Random(blocks).sample(range(self.num_blocks), self.num_blocks)
        skip = skip % (length + 1) if skip < MAX_TOKENS // 4 else 0  # most stores unmasked
        mask = torch.arange(length) >= skip
        for rank in group:
            caches = empty_caches(rank.layout, self.num_blocks, scrambled=self.CELL.scrambled)
            slots = block_slots(rank.layout, table, length)
            self._write(rank, caches, tokens, slots, range(length), tenant)
            rank.engine.store(tokens, caches, slots, mask if skip else None, request=_request(tenant))
        if wait:  # 3 in 4 stores
            for rank in group:
                rank.engine.flush()
        else:  # loads meanwhile read what is queued, or miss it: correct KV, any amount of it
            self.unflushed = True
        self.asked.append((prompt, length, tenant))
        ends = [e for e in self._stores(tokens) if e > skip]
        for rank in group:
            if rank.heads.writer:
                for label in self._labels(rank, rank.heads.group):
                    self.stored.setdefault((tenant, label), set()).update(tuple(tokens[:e]) for e in ends)

    @rule(
        which=st.integers(0, 3),
        prompt=st.integers(0, len(PROMPTS) - 1),
        length=st.integers(1, MAX_TOKENS),
        layers=st.integers(0, 2),
    )
    def abandon_a_layerwise_store(self, which: int, prompt: int, length: int, layers: int) -> None:
        """A layer-wise store given up before its last layer (a request aborted) stores nothing;
        its caches hold garbage past the layers copied, which no load may return."""
        group = self.groups[which % len(self.groups)]
        tokens = PROMPTS[prompt][:length]
        for rank in group:
            caches = empty_caches(rank.layout, self.num_blocks, scrambled=self.CELL.scrambled)
            slots = block_slots(rank.layout, list(range(self.num_blocks)), length)
            self._write(rank, caches, tokens, slots, range(length), 0)
            for tensor in flat(caches[layers:]):  # layers not computed yet
                tensor.fill_(7.0)
            steps = rank.engine.store_layerwise(tokens, caches, slots)
            for _ in range(min(layers, rank.layout.num_layers - 1)):
                next(steps)
            steps.close()
        for rank in group:
            rank.engine.flush()

    @rule(**PROMPT_DRAWS)
    def retrieve(self, which: int, prompt: int, length: int, blocks: int, tenant: int, skip: int) -> None:
        self._retrieve(which, prompt, length, blocks, tenant, skip)

    @precondition(lambda self: bool(self.asked))
    @rule(
        which=st.integers(0, 3),
        pick=st.integers(0, 10**6),
        more=st.integers(-8, 8),
        blocks=st.integers(0, 2**32),
        skip=st.integers(0, MAX_TOKENS),
    )
    def retrieve_a_stored_prompt(self, which: int, pick: int, more: int, blocks: int, skip: int) -> None:
        """A prompt stored before, give or take a few tokens: the loads that hit."""
        prompt, length, tenant = self.asked[-1 - pick % min(3, len(self.asked))]  # one of the latest
        self._retrieve(which, prompt, min(MAX_TOKENS, max(1, length + more)), blocks, tenant, skip)

    def _retrieve(self, which: int, prompt: int, length: int, blocks: int, tenant: int, skip: int) -> None:
        """Every rank of an engine loads a prompt whose first ``skip`` tokens it holds (masked)."""
        group = self.groups[which % len(self.groups)]
        tokens = PROMPTS[prompt][:length]
        table = random.Random(blocks).sample(range(self.num_blocks), self.num_blocks)
        skip = skip % (length + 1) if skip < MAX_TOKENS // 4 else 0  # most loads unmasked
        request = _request(tenant)
        for number, rank in enumerate(group):
            layout = rank.layout
            slots = block_slots(layout, table, length)
            claimed = rank.engine.lookup(tokens, request=request)
            inline = rank.engine.locate_inline(tokens, request=request, count=False)
            caches = empty_caches(layout, self.num_blocks, scrambled=self.CELL.scrambled)
            self._write(rank, caches, tokens, slots, range(skip), tenant)
            mask = torch.arange(length) >= skip
            loaded = rank.engine.retrieve(tokens, caches, slots, mask if skip else None, request=request)
            first = -(-skip // layout.block_size) * layout.block_size if layout.whole_blocks_only else skip
            start, end = first, first + int(loaded.sum())
            where = (
                f"rank {number} of TP {len(group)}, {length} tokens of prompt {prompt}, tenant {tenant}, skip {skip}"
            )
            assert bool(loaded[start:end].all()), f"{where}: not the run from {first} loaded: {loaded.int().tolist()}"
            if inline is not None:  # the scheduler's answer from memory tiers alone is the lookup's
                assert hit_tokens(inline) == claimed, f"{where}: inline lookup {hit_tokens(inline)}, lookup {claimed}"
            if not skip:
                assert end <= claimed, f"{where}: loaded {end} tokens, lookup said {claimed}"
            self._check_kv(rank, caches, tokens, slots, skip, range(start, end), tenant, where)
            # Pins hold in the process that made them: only where one process evicts the shared tier.
            one_process = self.CELL.tps == (1,)
            if (
                one_process
                and not (self.corrupted or self.unflushed)
                and not skip
                and (prompt, length, tenant) in self.pinned[0]
            ):
                pinned = max(self._stores(tokens), default=0)
                assert end >= pinned, f"{where}: loaded {end} tokens of a prompt pinned up to {pinned}"
            if not (self.corrupted or self.unflushed) and self.CELL.shared_max_bytes is None:
                held = self._expected(rank, tokens, tenant)
                assert claimed == held, f"{where}: lookup said {claimed}, the stores hold {held}"
                expected = max(first, self._expected(rank, tokens, tenant, first))
                assert end == expected, f"{where}: loaded [{start}, {end}), the stores hold up to {expected}"

    def _write(
        self, rank: Rank, caches: list[Any], tokens: list[int], slots: torch.Tensor, span: range, tenant: int
    ) -> None:
        write_tokens(rank.layout, caches, tokens, slots, rank.heads.first, self._total(), span, tenant=tenant)

    def _check_kv(
        self,
        rank: Rank,
        caches: list[Any],
        tokens: list[int],
        slots: torch.Tensor,
        skip: int,
        loaded: range,
        tenant: int,
        where: str,
    ) -> None:
        """Tokens before ``skip`` (the engine's) and the ``loaded`` ones hold their KV; nothing else is written."""
        layout = rank.layout
        want = empty_caches(layout, self.num_blocks)
        self._write(rank, want, tokens, slots, range(skip), tenant)
        self._write(rank, want, tokens, slots, loaded, tenant)
        masks = token_mask(layout, want, slots, loaded)
        for got, expected, mask in zip(flat(caches), flat(want), flat(masks)):
            assert torch.equal(got[~mask].view(torch.uint8), expected[~mask].view(torch.uint8)), (
                f"{where}: written outside the loaded tokens"
            )
            if not self.CELL.lossy:
                assert torch.equal(got[mask].view(torch.uint8), expected[mask].view(torch.uint8)), f"{where}: wrong KV"
            elif bool(mask.any()):
                inside, truth = got[mask].float(), expected[mask].float()
                # A record may hold more heads than this rank (another TP size's): its scales are the
                # largest magnitude of the token's row over every head of the model, at most.
                largest = max(
                    float(prefix_kv(layout, self._total(), [-tenant] * bool(tenant) + tokens[: t + 1]).abs().max())
                    for t in loaded
                )
                bound = _lossy_bound(self.CELL.serializer, truth, largest)
                assert bool(((inside - truth).abs() <= bound).all()), (
                    f"{where}: KV past the {self.CELL.serializer} bound"
                )

    def _total(self) -> int:
        return 1 if self.CELL.latent else self.CELL.heads

    @rule(pick=st.integers(0, 10**6), offset=st.integers(0, 10**6), flip=st.integers(1, 255), cut=st.booleans())
    def corrupt_a_record(self, pick: int, offset: int, flip: int, cut: bool) -> None:
        """Flip a byte of a stored record, or cut it short (one draw in three: after that the
        loads are checked for correct KV only, so a run should hold some without)."""
        if pick % 3:
            return
        files = sorted(f for folder in self.folders.values() for f in folder.rglob("*.kvr"))
        if not files:
            return
        path = files[pick % len(files)]
        data = bytearray(path.read_bytes())
        if not data:
            return
        if cut:
            data = data[: offset % len(data)]
        else:
            data[offset % len(data)] ^= flip
        path.write_bytes(bytes(data))
        self.corrupted += 1

    def teardown(self) -> None:
        for group in self.groups:
            self._close(group)
        for folder in self.folders.values():
            shutil.rmtree(folder, ignore_errors=True)


def _label(start: int, count: int, total: int) -> str:
    return f"{start}-{start + count}/{total}"


def _root(kind: str) -> str | None:
    return "/dev/shm" if kind == "shm" and Path("/dev/shm").is_dir() else None


def _request(tenant: int) -> RequestInfo | None:
    """Tenant 0 sends no salt; the others theirs."""
    return RequestInfo(cache_salt=f"tenant-{tenant}") if tenant else None


def _lossy_bound(name: str, truth: torch.Tensor, amax: float) -> torch.Tensor:
    """A loose form of kvplug_compress's bound: the scale taken from the largest magnitude of
    the whole tensor (at least a group's), plus rounding to a 2-byte float."""
    rounding = truth.abs() * 2.0**-7 + 2.0**-14
    if name == "int8":
        return amax / 127 * 0.5 * (1 + 2.0**-9) + rounding
    return torch.maximum(truth.abs() * 2.0**-4, torch.full_like(truth, amax / 448 * 2.0**-10)) + rounding
