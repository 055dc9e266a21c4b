"""The KV event bridge without SGLang's engine: what routers are told of chunks it stops
tracking, and of chunks held by two tiers of one type (a real kvplug cache engine's)."""

from __future__ import annotations

from pathlib import Path

import torch
from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

from kvplug import CacheEngine, Fingerprint, KVEvent, KVLayout, PagedFormat, load_config
from kvplug.testing import key_for
from kvplug_sglang.events import KVEventBridge, block_hash


def test_a_held_chunk_the_bridge_stops_tracking_is_told_removed() -> None:
    """Past ``max_tracked`` held chunks the oldest is forgotten: its later eviction could no longer
    be published, so a router would believe it held for good. It is told removed when forgotten."""
    bridge = KVEventBridge({"cpu": "memory", "disk": "disk"}, max_tracked=2)
    keys = [key_for(f"chunk{i}") for i in range(3)]
    bridge.expect(keys[:2], [(0, 4), (4, 8)], list(range(8)), None)
    bridge.observe(KVEvent("stored", tuple(keys[:2]), tier="cpu"))
    bridge.observe(KVEvent("stored", (keys[0],), tier="disk"))
    assert [type(e) for e in bridge.take()] == [BlockStored, BlockStored, BlockStored]
    bridge.expect(keys[2:], [(8, 12)], list(range(12)), None)
    assert bridge.take() == []  # no tier holds the third yet: the two held are all tracked
    bridge.observe(KVEvent("stored", (keys[2],), tier="cpu"))  # the third held: the first is forgotten
    told = bridge.take()
    assert [(type(e), e.block_hashes, e.medium) for e in told] == [
        (BlockRemoved, [block_hash(keys[0])], "CPU_PINNED"),
        (BlockRemoved, [block_hash(keys[0])], "DISK"),
        (BlockStored, [block_hash(keys[2])], "CPU_PINNED"),
    ]
    bridge.observe(KVEvent("evicted", (keys[0],), tier="cpu"))  # no longer tracked: nothing more
    bridge.expect(keys[:1], [(0, 4)], list(range(4)), None)  # tracked again, held again: the second is forgotten
    bridge.observe(KVEvent("stored", (keys[0],), tier="cpu"))
    assert [(type(e), e.block_hashes, e.medium) for e in bridge.take()] == [
        (BlockRemoved, [block_hash(keys[1])], "CPU_PINNED"),
        (BlockStored, [block_hash(keys[0])], "CPU_PINNED"),
    ]


def test_the_bridge_tracks_what_the_tiers_hold_not_every_chunk_ever_stored() -> None:
    """A chunk that left every tier, and writes that never landed (declined, dropped), are not
    tracked for good: a server that runs for weeks keeps the chunks its tiers hold, and a few."""
    bridge = KVEventBridge({"cpu": "memory", "disk": "disk"})
    keys = [key_for(f"chunk{i}") for i in range(5)]
    bridge.expect(keys[:2], [(0, 4), (4, 8)], list(range(8)), None)
    bridge.observe(KVEvent("stored", (keys[0],), tier="cpu"))
    bridge.observe(KVEvent("stored", (keys[0],), tier="disk"))
    bridge.observe(KVEvent("evicted", (keys[0],), tier="cpu"))
    assert bridge.chunks.held_keys() == [keys[0]]  # disk still holds it
    bridge.observe(KVEvent("evicted", (keys[0],), tier="disk"))
    assert bridge.chunks.held_keys() == [] and bridge.chunks.holders(keys[0]) == set()
    bridge.take()
    bridge.observe(KVEvent("stored", (keys[0],), tier="disk"))  # a write landing later is still told
    assert [(type(e), e.medium) for e in bridge.take()] == [(BlockStored, "DISK")]
    bounded = KVEventBridge({"cpu": "memory"}, max_waiting=2)
    bounded.expect(keys[2:], [(8, 12), (12, 16), (16, 20)], list(range(20)), None)  # never stored
    assert bounded.chunks.waiting_keys() == keys[3:] and bounded.chunks.held_keys() == []


def test_a_chunk_one_of_two_disk_tiers_evicts_is_not_told_removed_while_the_other_holds_it(tmp_path: Path) -> None:
    """Two tiers of one type (two disk folders) are one medium, ``DISK``. The first (small)
    evicting a chunk the second still holds must not tell routers it is gone (they would stop
    sending its prefix here while the second tier still serves it); the second removing it does."""
    layout = KVLayout(PagedFormat("paged_test", ("kv", "block", "token", "head", "dim")), 3, 8, 2, 4, torch.bfloat16)
    small = {"type": "disk", "path": str(tmp_path / "small"), "max_bytes": 4000}  # two 16-token chunks
    kv = {
        "chunk_size": 16,
        "store": {"queue": {"mode": "sync"}},
        "tiers": [small, {"type": "disk", "path": str(tmp_path / "big")}],
    }
    config = load_config(engine_extra={"kvplug": kv}, env={}).config
    caches = [torch.randn(2, 16, 8, 2, 4).to(torch.bfloat16) for _ in range(3)]
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="two-disks")) as engine:
        bridge = KVEventBridge({tier.name: tier.medium for tier in engine.chain.tiers})
        engine.add_event_listener(bridge.observe)
        first, second = list(range(32)), list(range(1000, 1032))
        for tokens in (first, second):
            keys = engine.chunk_keys(tokens)
            bridge.expect([k.key for k in keys], [(k.start, k.end) for k in keys], tokens, None)
            engine.store(tokens, caches, torch.arange(32))
            engine.flush()
        first_keys = [k.key for k in engine.chunk_keys(first)]
        small_tier, big_tier = engine.chain.tiers
        assert small_tier.contains(first_keys) == [False, False]  # the small one evicted them
        assert big_tier.contains(first_keys) == [True, True]
        events = bridge.take()
        big_tier.remove(first_keys)  # now no disk tier holds them: told removed
        gone = bridge.take()
    assert [e for e in events if isinstance(e, BlockRemoved)] == []
    assert [(type(e), e.medium) for e in events] == [(BlockStored, "DISK")] * 4
    assert [(type(e), e.medium, sorted(e.block_hashes)) for e in gone] == [
        (BlockRemoved, "DISK", sorted(block_hash(k) for k in first_keys))
    ]


def test_a_write_landing_late_is_told_though_more_chunks_than_max_waiting_came_after_it(tmp_path: Path) -> None:
    """An async tier's write lands after more chunks than ``max_waiting`` that no tier holds
    (writes dropped or declined) were expected: on ee9bb23 the oldest waiting chunk, the one
    whose write was still queued, was forgotten, and its ``stored`` then named nothing, so
    routers never learnt the tier holds it (a missed hit for as long as it does). The chunks
    forgotten are those whose writes can no longer land."""
    import threading

    layout = KVLayout(PagedFormat("paged_test", ("kv", "block", "token", "head", "dim")), 3, 8, 2, 4, torch.bfloat16)
    kv = {
        "chunk_size": 16,
        "store": {"queue": {"mode": "sync"}},
        "tiers": [{"type": "disk", "path": str(tmp_path / "d"), "queue": {"mode": "async"}}],
    }
    config = load_config(engine_extra={"kvplug": kv}, env={}).config
    caches = [torch.randn(2, 16, 8, 2, 4).to(torch.bfloat16) for _ in range(3)]
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="late-write")) as engine:
        bridge = KVEventBridge({"disk": "disk"}, max_waiting=2, in_flight=engine.writes_in_flight)
        gate, stuck = threading.Event(), threading.Event()

        def listener(event: KVEvent) -> None:
            if event.tier == "disk" and not gate.is_set():  # the disk tier's write thread waits here
                stuck.set()
                gate.wait()
            bridge.observe(event)

        engine.add_event_listener(listener)
        engine.store(list(range(16)), caches, torch.arange(16))  # its "stored" holds the write thread
        stuck.wait()
        late = list(range(100, 116))
        late_key = engine.chunk_keys(late)[0]
        bridge.expect([late_key.key], [(0, 16)], late, None)
        engine.store(late, caches, torch.arange(16))  # queued behind the stuck write
        never = [key_for(f"dropped{i}") for i in range(2)]  # writes that never land
        bridge.expect(never, [(0, 16), (16, 32)], list(range(32)), None)
        gate.set()
        engine.flush()
    told = [(type(e), e.medium) for e in bridge.take() if block_hash(late_key.key) in e.block_hashes]
    assert told == [(BlockStored, "DISK")]  # ee9bb23: [] (forgotten before its write landed)
    assert bridge.chunks.waiting_keys() == [never[1]]


def test_a_record_found_at_restart_is_announced_only_where_a_load_promotes_it(tmp_path: Path) -> None:
    """A disk tier's records from before the process started carry no tokens (a record names its
    chunk by a digest), so nothing announces them at start. Loaded after the restart, the chunk is
    announced for the faster tier the load promotes it to; the disk tier, which wrote nothing,
    says nothing of it (docs/fleet.md)."""
    layout = KVLayout(PagedFormat("paged_test", ("kv", "block", "token", "head", "dim")), 3, 8, 2, 4, torch.bfloat16)
    disk = {"type": "disk", "path": str(tmp_path / "d")}
    caches = [torch.randn(2, 16, 8, 2, 4).to(torch.bfloat16) for _ in range(3)]
    tokens = list(range(16))
    fingerprint = Fingerprint.for_layout(layout, model_id="restart")
    first = {"chunk_size": 16, "store": {"queue": {"mode": "sync"}}, "tiers": [disk]}
    with CacheEngine(load_config(engine_extra={"kvplug": first}, env={}).config, layout, fingerprint) as engine:
        engine.store(tokens, caches, torch.arange(16))
    again = {**first, "tiers": [{"type": "cpu"}, disk]}
    with CacheEngine(load_config(engine_extra={"kvplug": again}, env={}).config, layout, fingerprint) as engine:
        bridge = KVEventBridge({tier.name: tier.medium for tier in engine.chain.tiers})
        engine.add_event_listener(bridge.observe)
        assert bridge.take() == []  # the record found at start: nothing to name it by
        (key,) = [k.key for k in engine.chunk_keys(tokens)]
        bridge.expect([key], [(0, 16)], tokens, None)
        assert int(engine.retrieve(tokens, caches, torch.arange(16)).sum()) == 16
        engine.flush()
        told = bridge.take()
    assert [(type(e), e.medium, e.block_hashes) for e in told] == [(BlockStored, "CPU_PINNED", [block_hash(key)])]


def test_what_routers_are_told_is_what_the_tiers_hold_through_evictions_corruption_and_clear(tmp_path: Path) -> None:
    """A hostile read of the bridge's events on a real engine (a small cpu tier that evicts, an
    async disk tier, async stores): replayed as a router would, they never remove a block first
    (or twice) and, after each phase (stores, a load that promotes, corrupt disk records found by
    loads, ``kvplug ctl clear --all``), name exactly what some tier of each medium holds."""
    from kvplug import EngineControl

    layout = KVLayout(PagedFormat("paged_test", ("kv", "block", "token", "head", "dim")), 3, 8, 2, 4, torch.bfloat16)
    kv = {
        "chunk_size": 16,
        "store": {"queue": {"mode": "async"}},
        "tiers": [
            {"type": "cpu", "max_bytes": 4000},  # two chunks
            {"type": "disk", "path": str(tmp_path / "d"), "queue": {"mode": "async"}},
        ],
    }
    config = load_config(engine_extra={"kvplug": kv}, env={}).config
    caches = [torch.randn(2, 16, 8, 2, 4).to(torch.bfloat16) for _ in range(3)]
    prompts = [list(range(1000 * p, 1000 * p + 32)) for p in range(5)]
    medium = {"cpu": "CPU_PINNED", "disk": "DISK"}
    view: dict[str, set[int]] = {"CPU_PINNED": set(), "DISK": set()}
    wrong: list[tuple[str, int]] = []  # (medium, block) removed while not announced there
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="hostile")) as engine:
        control = EngineControl(engine)
        bridge = KVEventBridge({tier.name: tier.medium for tier in engine.chain.tiers})
        engine.add_event_listener(bridge.observe)
        keys = [k.key for tokens in prompts for k in engine.chunk_keys(tokens)]

        def check(phase: str) -> None:
            engine.flush()
            for event in bridge.take():
                for h in event.block_hashes:
                    if isinstance(event, BlockStored):
                        view[event.medium].add(h)
                    elif h in view[event.medium]:
                        view[event.medium].discard(h)
                    else:
                        wrong.append((event.medium, h))
            assert wrong == [], phase
            truth: dict[str, set[int]] = {"CPU_PINNED": set(), "DISK": set()}
            for tier in engine.chain.tiers:
                held = tier.contains(keys)
                truth[medium[tier.name]] |= {block_hash(k) for k, has in zip(keys, held) if has}
            assert view == truth, phase

        for tokens in prompts:
            chunks = engine.chunk_keys(tokens)
            bridge.expect([k.key for k in chunks], [(k.start, k.end) for k in chunks], tokens, None)
            engine.store(tokens, caches, torch.arange(32))
        check("stores")
        assert view["DISK"] and view["CPU_PINNED"]
        chunks = engine.chunk_keys(prompts[0])
        bridge.expect([k.key for k in chunks], [(k.start, k.end) for k in chunks], prompts[0], None)
        assert int(engine.retrieve(prompts[0], caches, torch.arange(32)).sum()) == 32
        check("a load promoting to cpu")
        for record in (tmp_path / "d").rglob("*"):
            if record.is_file() and record.stat().st_size > 1000:
                data = bytearray(record.read_bytes())
                data[-100] ^= 0xFF
                record.write_bytes(bytes(data))
        for tokens in prompts[1:3]:  # only on the disk tier now: corrupt, misses, removed
            assert int(engine.retrieve(tokens, caches, torch.arange(32)).sum()) == 0
        check("corrupt records found")
        control.remove(control.planned_clear)
        check("ctl clear --all")
        assert view == {"CPU_PINNED": set(), "DISK": set()}


def test_events_dropped_past_max_events_never_include_a_removal_of_a_block_told_stored() -> None:
    """Past ``max_events`` untaken events the oldest were dropped, whatever they were (on a179627):
    a ``BlockRemoved`` of a block whose ``BlockStored`` a router already took left it believing
    the block held for good. Stored events go first, and with them their blocks' removals."""
    bridge = KVEventBridge({"cpu": "memory"}, max_events=2)
    keys = [key_for(f"bound{i}") for i in range(4)]
    bridge.expect(keys, [(0, 4), (4, 8), (8, 12), (12, 16)], list(range(16)), None)
    bridge.observe(KVEvent("stored", (keys[0],), tier="cpu"))
    assert [type(e) for e in bridge.take()] == [BlockStored]  # a router heard the first held
    bridge.observe(KVEvent("evicted", (keys[0],), tier="cpu"))
    bridge.observe(KVEvent("stored", (keys[1],), tier="cpu"))
    bridge.observe(KVEvent("stored", (keys[2],), tier="cpu"))  # one too many: a stored goes, not the removal
    bridge.observe(KVEvent("evicted", (keys[1], keys[2]), tier="cpu"))  # untold blocks: not told removed
    bridge.observe(KVEvent("stored", (keys[3],), tier="cpu"))
    told = [(type(e), e.block_hashes) for e in bridge.take()]
    assert (BlockRemoved, [block_hash(keys[0])]) in told, told
    assert told == [(BlockRemoved, [block_hash(keys[0])]), (BlockStored, [block_hash(keys[3])])]
    assert bridge.dropped == 3  # the second's and third's stored, and the removal of the third (queued)
