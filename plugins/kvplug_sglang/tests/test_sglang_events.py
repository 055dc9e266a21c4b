"""The KV event bridge alone (no engine): what routers are told of chunks it stops tracking."""

from __future__ import annotations

from sglang.srt.disaggregation.kv_events import BlockRemoved, BlockStored

from kvplug import KVEvent
from kvplug.testing import key_for
from kvplug_sglang.events import KVEventBridge, block_hash


def test_a_held_chunk_the_bridge_stops_tracking_is_told_removed() -> None:
    """Past ``max_tracked`` the oldest chunk is forgotten: its later eviction could no longer be
    published, so a router would believe it held for good. It is told removed when forgotten."""
    bridge = KVEventBridge({"cpu": "memory", "disk": "disk"}, max_tracked=2)
    keys = [key_for(f"chunk{i}") for i in range(3)]
    bridge.expect(keys[:2], [(0, 4), (4, 8)], list(range(8)), None)
    bridge.observe(KVEvent("stored", tuple(keys[:2]), tier="cpu"))
    bridge.observe(KVEvent("stored", (keys[0],), tier="disk"))
    assert [type(e) for e in bridge.take()] == [BlockStored, BlockStored, BlockStored]
    bridge.expect(keys[2:], [(8, 12)], list(range(12)), None)  # the third: the first is forgotten
    told = bridge.take()
    assert [(type(e), e.block_hashes, e.medium) for e in told] == [
        (BlockRemoved, [block_hash(keys[0])], "CPU_PINNED"),
        (BlockRemoved, [block_hash(keys[0])], "DISK"),
    ]
    bridge.observe(KVEvent("evicted", (keys[0],), tier="cpu"))  # no longer tracked: nothing more
    bridge.expect(keys[:1], [(0, 4)], list(range(4)), None)  # tracked again: the second (held by cpu) is forgotten
    assert [(type(e), e.medium) for e in bridge.take()] == [(BlockRemoved, "CPU_PINNED")]
