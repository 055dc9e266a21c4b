"""The fleet state machine of test_engine_oracle_cells.py: engines of several TP sizes over
shared tiers, each load checked against the KV oracle (tests/kv_oracle.py) and against what
the stores so far hold (oracle_fleet_model.py); a test sets its ``CELL``, the configuration.
Imported by name, as core_helpers is."""

from __future__ import annotations

import random
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from kv_oracle import block_slots, empty_caches, flat, prefix_kv, token_mask, write_tokens
from oracle_fleet_model import Cell, Rank, SharedTiers, engine_config

from kvplug import CacheEngine, Fingerprint, HeadShard, KVLayout, RequestInfo, load_config
from kvplug.core.engine.locations import hit_tokens
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
        #: What the shared tiers hold, by the stores so far.
        self.shared = SharedTiers(cell, self.full)
        self.corrupted = 0
        self.unflushed: set[int] = set()  # engines with stores not waited for (queued)
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
        extra = {"kvplug": engine_config(self.CELL, layout, self.folders)}
        config = load_config(engine_extra=extra, env={}, registry=self.registry)
        return CacheEngine(
            config.config,
            layout,
            Fingerprint.for_layout(layout, model_id="oracle"),
            registry=self.registry,
            heads=heads,
        )

    def _close(self, group: list[Rank]) -> None:
        for rank in group:
            rank.engine.close()

    # --- rules ----------------------------------------------------------------------

    @rule(which=st.integers(0, 3))
    def restart(self, which: int) -> None:
        """New processes of one engine on the same folders: empty cpu tiers, indexes rebuilt."""
        index = which % len(self.groups)
        self._close(self.groups[index])
        self.groups[index] = self._open(self.CELL.tps[index])
        self.pinned[index].clear()  # pins live in the process that made them
        self.unflushed.discard(index)  # (a close writes what is queued)

    @rule()
    def flush(self) -> None:
        """Wait for every store so far (a restart drains its engine's queue too)."""
        for group in self.groups:
            for rank in group:
                rank.engine.flush()
        self.unflushed.clear()

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
        index = which % len(self.groups)
        group = self.groups[index]
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
        elif "async" in (self.CELL.queue, self.CELL.tier_queue):  # (sync queues: written on return)
            self.unflushed.add(index)
        self.asked.append((prompt, length, tenant))
        ends = [e for e in self.shared.stores(tokens) if e > skip]
        for rank in group:
            if rank.heads.writer:
                self.shared.add(rank, tokens, ends, tenant)

    @rule(**PROMPT_DRAWS)
    def store_and_load_at_once(self, which: int, prompt: int, length: int, blocks: int, tenant: int, skip: int) -> None:
        """A store not waited for, loaded at once by its engine: from the tiers' write queues
        (readable at once) while they write it."""
        self.store(which, prompt, length, blocks, tenant, 0, 0)
        self._retrieve(which, prompt, length, blocks, tenant, skip)

    @precondition(lambda self: self.CELL.quotas is not None)
    @rule(
        which=st.integers(0, 3),
        prompt=st.integers(0, len(PROMPTS) - 1),
        length=st.integers(8, 24),
        other=st.integers(0, len(PROMPTS) - 1),
        blocks=st.integers(0, 2**32),
        tenant=st.sampled_from([0, 2]),
    )
    def overflow_a_quota(self, which: int, prompt: int, length: int, other: int, blocks: int, tenant: int) -> None:
        """Another tenant's prompt stored, then tenant 1 past its quota (a whole prompt is more
        than its quota), then that prompt loaded: whole, while its tenant is within its quota."""
        self.store(which, prompt, length, blocks, tenant, 0, 1)
        self.store(which, other, MAX_TOKENS, blocks, 1, 0, 1)
        self._retrieve(which, prompt, length, blocks, tenant, 0)

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
            if rank.heads.writer:  # (no record: its manifest, at most, counts against the budget)
                self.shared.add(rank, tokens, [], 0)

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
        index = which % len(self.groups)
        group = self.groups[index]
        tokens = PROMPTS[prompt][:length]
        table = random.Random(blocks).sample(range(self.num_blocks), self.num_blocks)
        skip = skip % (length + 1) if skip < MAX_TOKENS // 4 else 0  # most loads unmasked
        request = _request(tenant)
        for number, rank in enumerate(group):
            layout = rank.layout
            slots = block_slots(layout, table, length)
            # Only with no store or removal in flight can nothing land between the lookup and the
            # load: a queued store, or a removal that finds another engine's good bytes and keeps them.
            sees_all = self._sees_every_store(index)
            settled = sees_all and not self._removals_in_flight()
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
            if inline is not None and settled:  # the scheduler's answer from memory tiers alone is the lookup's
                assert hit_tokens(inline) == claimed, f"{where}: inline lookup {hit_tokens(inline)}, lookup {claimed}"
            if settled and not skip:
                assert end <= claimed, f"{where}: loaded {end} tokens, lookup said {claimed}"
            self._check_kv(rank, caches, tokens, slots, skip, range(start, end), tenant, where)
            # Pins hold in the process that made them: only where one process evicts the shared tier.
            one_process = self.CELL.tps == (1,)
            if (
                one_process
                and not self.corrupted
                and sees_all
                and not skip
                and (prompt, length, tenant) in self.pinned[0]
            ):
                pinned = max(self.shared.stores(tokens), default=0)
                assert end >= pinned, f"{where}: loaded {end} tokens of a prompt pinned up to {pinned}"
            if not self.corrupted and sees_all and self.shared.keeps_all(tenant):
                held = self.shared.expected(rank, tokens, tenant)
                assert claimed == held, f"{where}: lookup said {claimed}, the stores hold {held}"
                expected = max(first, self.shared.expected(rank, tokens, tenant, first))
                assert end == expected, f"{where}: loaded [{start}, {end}), the stores hold up to {expected}"

    def _sees_every_store(self, index: int) -> bool:
        """Whether engine ``index``'s loads see every store so far: none is queued, or (a sync
        store queue) only its own are, in its tiers' write queues, whose values are readable at
        once, and each of its ranks reads the records it writes (no replicated heads)."""
        if not self.unflushed:
            return True
        own = self.unflushed == {index} and all(rank.heads.writer for rank in self.groups[index])
        return own and self.CELL.queue == "sync"

    def _removals_in_flight(self) -> bool:
        """Whether any engine's removal of a chunk a load found unusable is still on its way."""
        return any(rank.engine.chain.being_removed([]) is not None for group in self.groups for rank in group)

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
        try:  # in place: a record a queued store evicts meanwhile is gone, not made again
            with files[pick % len(files)].open("r+b") as file:
                data = file.read()
                if not data:
                    return
                if cut:
                    file.truncate(offset % len(data))
                else:
                    file.seek(offset % len(data))
                    file.write(bytes([data[offset % len(data)] ^ flip]))
        except FileNotFoundError:
            return
        self.corrupted += 1

    def teardown(self) -> None:
        for group in self.groups:
            self._close(group)
        for folder in self.folders.values():
            shutil.rmtree(folder, ignore_errors=True)


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
