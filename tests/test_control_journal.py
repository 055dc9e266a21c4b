"""The control journal keeps only keys some tier may still hold, plus a bounded few waiting.

Before, it kept every key ever stored, loaded or written (up to 2**20, ~330 MB a process)
whatever the tiers still held; a soak held 197 keys while the tiers held 38.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import CacheEngine, EngineControl, Fingerprint, HeadShard, KVEvent, RequestInfo, load_config
from kvplug.core.control.journal import ChunkJournal

LAYOUT = LAYOUTS["vllm_flash"]  # float16, block 4: a chunk of 8 tokens is 1.5 KiB
CHUNK = 8


def none_landing(keys: object) -> list[bool]:
    """No write is in flight (the key just noted is kept all the same: its write comes next)."""
    return [False] * len(keys)  # type: ignore[arg-type]


def tier_stored(keys: list[str], index: int) -> KVEvent:
    return KVEvent("stored", tuple(keys), tier="cpu", tier_index=index)


def evicted(keys: list[str], index: int) -> KVEvent:
    return KVEvent("evicted", tuple(keys), tier="cpu", tier_index=index)


def test_a_sync_tiers_events_before_the_engines_own_are_kept_and_classified() -> None:
    """A sync tier's ``stored`` and the chain's write notice come before the engine's ``stored``;
    a promotion's write before its ``loaded``: the keys are listed as stored, and as loaded."""
    journal = ChunkJournal(max_waiting=0)
    journal.on_event(tier_stored(["a"], 0))
    journal.on_written(0, ["a"])
    journal.on_event(KVEvent("stored", ("a",)))
    journal.on_event(tier_stored(["b"], 0))  # a promotion of b, then its load
    journal.on_written(0, ["b"])
    journal.on_event(KVEvent("loaded", ("b",)))
    assert journal.split() == (["a"], ["b"])
    assert journal.written_now(["a", "b"]) == {0: ["a", "b"]}


def test_keys_no_tier_holds_are_forgotten_past_max_waiting_oldest_landed_first() -> None:
    landing = {"q"}
    journal = ChunkJournal(max_waiting=2, in_flight=lambda keys: [key in landing for key in keys])
    journal.stored(["q"])  # its write is still queued: kept past max_waiting
    for key in ["a", "b", "c"]:
        journal.on_event(tier_stored([key], 1))
        journal.stored([key])
    journal.on_event(evicted(["a", "b", "c"], 1))  # they left the only tier holding them
    assert journal.keys() == ["q", "c"]
    assert journal.waiting_count() == 2 and journal.held_count() == 0
    assert journal.forgotten == 0  # no tier holds what was dropped: clear loses nothing
    journal.on_event(tier_stored(["q"], 1))  # landed
    assert journal.held_count() == 1 and journal.waiting_count() == 1


def test_a_key_held_by_two_tiers_waits_only_once_both_evicted_it() -> None:
    journal = ChunkJournal(max_waiting=0, in_flight=none_landing)
    journal.stored(["a"])
    journal.on_event(tier_stored(["a"], 0))
    journal.on_event(tier_stored(["a"], 1))
    journal.on_event(evicted(["a"], 0))
    assert journal.keys() == ["a"]
    journal.on_event(evicted(["a"], 1))
    assert journal.keys() == [] and len(journal) == 0


def test_held_keys_past_max_held_are_forgotten_and_counted() -> None:
    """A tier whose evictions nobody reports keeps its keys held: ``max_held`` bounds them."""
    journal = ChunkJournal(max_held=2)
    for key in ["a", "b", "c"]:
        journal.stored([key])
        journal.on_event(tier_stored([key], 0))
    assert journal.keys() == ["b", "c"] and journal.forgotten == 1


def test_a_journal_that_hears_no_tier_events_keeps_every_key_up_to_max_held() -> None:
    journal = ChunkJournal(max_held=2, max_waiting=0, hears_tiers=False)
    for key in ["a", "b", "c"]:
        journal.stored([key])
    assert journal.keys() == ["b", "c"] and journal.forgotten == 1


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[CacheEngine]:
    # Both tiers evict: about 5 chunks in memory, 10 on disk.
    tiers = [{"type": "cpu", "max_bytes": "8KiB"}, {"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "16KiB"}]  # fmt: skip
    extra = {"kvplug": {"chunk_size": CHUNK, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")) as cache:
        yield cache


def held_by_tiers(engine: CacheEngine, keys: list[str]) -> set[str]:
    held: set[str] = set()
    for tier in engine.chain.tiers:
        held.update(key for key, there in zip(keys, tier.contains(keys)) if there)
    return held


def test_with_evicting_tiers_the_journal_keeps_what_they_hold_and_a_few_waiting(engine: CacheEngine) -> None:
    control = EngineControl(engine)
    control.journal.max_waiting = 4
    caches = random_caches(LAYOUT, 80)
    try:
        for prompt in range(40):
            tokens = list(range(1000 * prompt, 1000 * prompt + 2 * CHUNK))  # two chunks each
            engine.store(tokens, caches, torch.arange(len(tokens)), request=RequestInfo())
            engine.flush()
        stored, _ = control.journal.split()
        held = held_by_tiers(engine, stored)
        # 202f2d0: all 80 chunks stored stayed in the journal, whatever the tiers held.
        assert len(stored) <= len(held) + 4, (len(stored), len(held))
        assert len(stored) < 40
        # The newest prompt is held and named: clear still removes every chunk the tiers hold.
        keys, _ = control.remove(control.planned_clear)
        assert set(keys.written) >= held and held
        assert not held_by_tiers(engine, stored)
    finally:
        control.close()


def test_a_salted_clear_removes_a_chunks_other_records_once_record_0_was_forgotten(tmp_path: Path) -> None:
    """A chunk is one record per head group. Once no tier holds record 0, the journal may forget
    it while another record is still held: a clear of the chunk's salt still removes that one."""
    tiers = [{"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "1MiB"}]
    extra = {"kvplug": {"chunk_size": CHUNK, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}).config
    heads = HeadShard(0, LAYOUT.num_kv_heads, 1)  # two records per chunk
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m"), heads=heads) as engine:
        control = EngineControl(engine)
        control.journal.max_waiting = 0
        try:
            salted = RequestInfo(cache_salt="tenant")
            tokens = list(range(2 * CHUNK))
            engine.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)), request=salted)
            engine.flush()
            stored, _ = control.journal.split()
            first, second = engine.records.record_prefixes(salted)
            record_0 = [key for key in stored if key.startswith(first)]
            others = [key for key in stored if key.startswith(second)]
            assert len(record_0) == len(others) == 2
            disk = engine.chain.tiers[0]
            disk.remove(record_0)  # record 0 left its only tier: forgotten (nothing waits)
            assert not set(record_0) & set(control.journal.keys())
            keys, _ = control.remove(lambda: control.planned_clear(salted))
            assert set(others) <= set(keys.written)
            assert not any(disk.contains(others))
        finally:
            control.close()


def test_a_salted_clear_removes_the_promoted_records_of_a_chunk_only_loaded(tmp_path: Path) -> None:
    """A load names its chunks by record 0's key while its promotions write every record: each
    counts as loaded, so a clear of the private tiers removes them also once record 0 is forgotten."""
    disk = {"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "1MiB"}
    heads = HeadShard(0, LAYOUT.num_kv_heads, 1)  # two records per chunk
    salted = RequestInfo(cache_salt="tenant")
    tokens = list(range(2 * CHUNK))

    def open_engine(tiers: list[dict[str, str]]) -> CacheEngine:
        extra = {"kvplug": {"chunk_size": CHUNK, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
        config = load_config(engine_extra=extra, env={}).config
        return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m"), heads=heads)

    with open_engine([disk]) as writer:
        writer.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)), request=salted)
        writer.flush()
    with open_engine([{"type": "cpu", "max_bytes": "1MiB"}, disk]) as reader:
        control = EngineControl(reader)
        control.journal.max_waiting = 0
        try:
            loaded = reader.retrieve(
                tokens, random_caches(LAYOUT, 80, seed=1), torch.arange(len(tokens)), request=salted
            )
            assert int(loaded.sum()) == len(tokens)
            reader.flush()
            first, second = reader.records.record_prefixes(salted)
            _, only_loaded = control.journal.split()
            record_0 = [key for key in only_loaded if key.startswith(first)]
            others = [key for key in only_loaded if key.startswith(second)]
            assert len(record_0) == len(others) == 2  # 202f2d0 (and without noting every record): others == []
            cpu = reader.chain.tiers[0]
            assert all(cpu.contains(others))
            cpu.remove(record_0)  # record 0 left the private tier; the journal never saw the disk hold it
            assert not set(record_0) & set(control.journal.keys())
            keys, _ = control.remove(lambda: control.planned_clear(salted))
            assert set(others) <= set(keys.loaded)
            assert not any(cpu.contains(others))
        finally:
            control.close()
