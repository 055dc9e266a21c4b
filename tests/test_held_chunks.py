"""kvplug.HeldChunks: which chunks some tier holds, per medium, as routers are told (the one
index kvplug-vllm's ChunkIndex and kvplug-sglang's KVEventBridge keep)."""

from __future__ import annotations

import pytest

from kvplug import HeldChange, HeldChunks, KVEvent


def media(tier: str) -> str:
    return {"cpu": "memory", "shm": "memory", "disk": "disk"}.get(tier, "remote")


def kinds(changes: list[HeldChange[str]]) -> list[tuple[str, str, str | None, bool]]:
    return [(c.kind, c.key, c.medium, c.first) for c in changes]


def test_a_chunk_is_stored_once_per_medium_and_removed_when_no_tier_of_it_holds_it() -> None:
    held: HeldChunks[str] = HeldChunks(media)
    held.expect("k", "tokens of k")
    assert held.observe(KVEvent("stored", ("k",))) == []  # the engine's hand-over: no tier holds it
    assert kinds(held.observe(KVEvent("stored", ("k",), tier="cpu", tier_index=0))) == [("stored", "k", "memory", True)]
    assert kinds(held.observe(KVEvent("stored", ("k",), tier="shm", tier_index=1))) == [
        ("stored", "k", "memory", False)
    ]
    # a tier that never said it holds it takes nothing back
    assert held.observe(KVEvent("evicted", ("k",), tier="disk", tier_index=2)) == []
    assert held.observe(KVEvent("evicted", ("k",), tier="cpu", tier_index=0)) == []  # shm still holds it
    assert kinds(held.observe(KVEvent("removed", ("k",), tier="shm", tier_index=1))) == [
        ("removed", "k", "memory", False)
    ]
    assert held.held_keys() == [] and held.waiting_keys() == ["k"] and held.holders("k") == set()
    # a write that lands after it left every tier is still told
    assert [c.chunk for c in held.observe(KVEvent("stored", ("k",), tier="disk", tier_index=2))] == ["tokens of k"]


def test_a_held_chunk_forgotten_past_max_held_names_the_media_that_held_it_before_a_later_store() -> None:
    held: HeldChunks[str] = HeldChunks(media, max_held=1)
    held.expect("a", "A")
    held.expect("b", "B")
    held.observe(KVEvent("stored", ("a",), tier="disk", tier_index=0))
    changes = held.observe(KVEvent("stored", ("b",), tier="cpu", tier_index=1))
    assert [(c.kind, c.key, c.media) for c in changes] == [("forgotten", "a", ("disk",)), ("stored", "b", ())]
    assert held.held_keys() == ["b"] and held.observe(KVEvent("evicted", ("a",), tier="disk", tier_index=0)) == []
    assert held.observe(KVEvent("stored", ("a",), tier="disk", tier_index=0)) == [] and held.unknown_stored == 1


def test_bounds_must_be_usable() -> None:
    with pytest.raises(ValueError, match="max_held >= 1"):
        HeldChunks(media, max_held=0)
