"""A record tier that keeps ``max_bytes`` by its index deletes a victim under no lock: a put of
the same key racing that delete must leave routers told what the store holds (a real
:class:`RecordTier` on an in-process store; real threads and a gate in the evicting thread)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
from core_helpers import ComparingDictBackend

from kvplug import RecordBackend, RecordTier, RecordTierConfig, TierContext
from kvplug.testing import key_for, value_for
from kvplug.testing.event_order import GATE_TIMEOUT_S


class _DictTier(RecordTier):
    name = "dict"
    Config = RecordTierConfig
    store: dict[str, bytes]

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        return ComparingDictBackend(self.store)


@pytest.mark.parametrize("lands", ["after-delete", "before-delete"])
def test_a_put_racing_the_eviction_of_its_key_leaves_routers_told_what_is_held(lands: str) -> None:
    """``c``'s put evicts ``a`` (the least recently used) and is held at a gate just after (or
    just before) the delete of ``a``; meanwhile ``a`` is put again. On a179627 the eviction's
    ``evicted a`` was queued after that put's ``stored a`` whatever the order: with the write
    landed after the delete, ``a`` was held and routers told it gone for as long as it is."""
    tier_class = type("DictTierOn", (_DictTier,), {"store": {}})
    told: list[tuple[str, tuple[str, ...]]] = []
    config = RecordTierConfig.model_validate({"max_bytes": 2500, "retries": 0, "request_timeout_s": 5.0})
    tier = tier_class(
        config, TierContext(logger=logging.getLogger("test"), emit=lambda e: told.append((e.kind, e.keys)))
    )
    a, b, c = key_for("a"), key_for("b"), key_for("c")
    tier.put([(a, value_for("a", 1000))])
    tier.put([(b, value_for("b", 1000))])
    at_gate, release = threading.Event(), threading.Event()
    real_delete = tier._delete_quietly

    def delete(names: list[str], *, forget: bool = True) -> None:
        gated = threading.current_thread().name == "put-c" and not at_gate.is_set()
        if gated and lands == "before-delete":
            at_gate.set()
            assert release.wait(GATE_TIMEOUT_S)
        real_delete(names, forget=forget)
        if gated and lands == "after-delete":
            at_gate.set()
            assert release.wait(GATE_TIMEOUT_S)

    tier._delete_quietly = delete  # type: ignore[method-assign]
    failures: list[BaseException] = []

    def put_c() -> None:
        try:
            tier.put([(c, value_for("c", 1000))])
        except BaseException as exc:  # reported below, not lost with the thread
            failures.append(exc)

    putter = threading.Thread(target=put_c, name="put-c")
    putter.start()
    try:
        assert at_gate.wait(GATE_TIMEOUT_S), "the put of c never evicted a"
        tier.put([(a, value_for("a", 1000))])  # a again: b is now the least recently used, evicted
    finally:
        release.set()
        putter.join(GATE_TIMEOUT_S)
    assert not putter.is_alive() and failures == []
    heard = list(told)  # before any lookup, which reports what it finds gone
    indexed = tier.stats().items
    held = tier.contains([a, b, c])
    assert held == [lands == "after-delete", False, True]
    last_of_a = [kind for kind, keys in heard if a in keys][-1]
    assert last_of_a == ("stored" if held[0] else "evicted"), heard  # a179627 (after-delete): evicted
    assert ("evicted", (b,)) in heard
    assert indexed == sum(held)  # a179627 (before-delete): 2, the record of a deleted still indexed
    tier.close()
