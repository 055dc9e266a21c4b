"""Each cache engine delivers its events (stores, loads, its tiers' removals and
evictions) to its own listeners only; the process-wide ``kvplug_on_event`` hook
still sees every engine's."""

from __future__ import annotations

import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import KVEvent, hookimpl
from kvplug.core.plugins import PluginRegistry

LAYOUT = LAYOUTS["vllm_flash"]
NUM_BLOCKS = 40


def engine_events(events: list[KVEvent]) -> list[KVEvent]:
    """The engine's own events: not its tiers' ``stored`` (tests/test_tier_events.py checks those)."""
    return [e for e in events if e.kind != "stored" or e.tier is None]


def tokens(start: int) -> list[int]:
    return list(range(start, start + 16))  # two chunks of 8


def test_two_engines_in_one_process_each_see_only_their_own_events(make_engine, registry: PluginRegistry) -> None:
    everything: list[KVEvent] = []

    class Observer:
        @staticmethod
        @hookimpl
        def kvplug_on_event(event: KVEvent) -> None:
            everything.append(event)

    registry.register(Observer, "observer")
    first = make_engine(LAYOUT, model_id="model-a")
    second = make_engine(LAYOUT, model_id="model-b")
    seen: dict[str, list[KVEvent]] = {"first": [], "second": []}
    first.add_event_listener(seen["first"].append)
    second.add_event_listener(seen["second"].append)
    caches = random_caches(LAYOUT, NUM_BLOCKS)
    slots = torch.arange(16)

    first.store(tokens(100), caches, slots)
    first_keys = tuple(chunk.key for chunk in first.chunk_keys(tokens(100)))
    assert [(e.kind, e.keys) for e in engine_events(seen["first"])] == [("stored", first_keys)]
    assert seen["second"] == []

    second.store(tokens(500), caches, slots)
    assert second.retrieve(tokens(500), random_caches(LAYOUT, NUM_BLOCKS), slots).all()
    second.chain.discard([chunk.key for chunk in second.chunk_keys(tokens(500))])
    second_keys = tuple(chunk.key for chunk in second.chunk_keys(tokens(500)))
    assert [e.kind for e in engine_events(seen["second"])] == ["stored", "loaded", "removed"]
    assert all(e.keys == second_keys for e in engine_events(seen["second"]))
    assert [e.kind for e in engine_events(seen["first"])] == ["stored"]  # nothing of the second engine's

    # The hook is process-wide: it saw both engines' events.
    assert [e.keys for e in engine_events(everything) if e.kind == "stored"] == [first_keys, second_keys]


def test_a_removed_or_failing_listener_does_not_stop_the_others(make_engine) -> None:
    engine = make_engine(LAYOUT)
    kept: list[str] = []
    removed: list[str] = []

    def faulty(event: KVEvent) -> None:
        raise RuntimeError("listener bug")

    def gone(event: KVEvent) -> None:
        removed.append(event.kind)

    engine.add_event_listener(faulty)
    engine.add_event_listener(gone)
    engine.add_event_listener(lambda event: kept.append(event.kind) if event.tier is None else None)
    engine.remove_event_listener(gone)
    engine.remove_event_listener(gone)  # a second removal is harmless
    caches = random_caches(LAYOUT, NUM_BLOCKS)
    assert engine.store(tokens(100), caches, torch.arange(16)) == 16
    assert engine.lookup(tokens(100)) == 16
    assert kept == ["stored"]
    assert removed == []
