"""A tier's events wait in its :class:`~kvplug.OrderedEvents` queue while another thread
delivers them: a slow listener must not let that queue grow without bound (real cpu tier)."""

from __future__ import annotations

import threading
import time

import pytest

from kvplug import KVEvent, OrderedEvents
from kvplug.core.plugins import PluginRegistry
from kvplug.testing import key_for


@pytest.fixture
def registry() -> PluginRegistry:
    return PluginRegistry(plugin_filter="cpu")


def test_a_slow_listener_holds_the_queue_of_a_tiers_events_to_its_bound(make_engine) -> None:
    """One thread delivers the cpu tier's events to a listener that is stuck (a gate); another
    keeps putting. Each put's ``stored`` is left to the delivering thread: on ee9bb23 the queue
    grew by one per put for as long as the listener was stuck (here 3 x the bound, unbounded in
    general). Past the bound the putting thread now waits for the queue to drain."""
    from core_helpers import LAYOUTS

    engine = make_engine(LAYOUTS["vllm_flash"], tiers=[{"type": "cpu"}])
    (tier,) = engine.chain.tiers
    events: OrderedEvents = tier._events  # the tier's queue (its bound is the default's)
    bound = 4096  # MAX_QUEUED_EVENTS
    gate, stuck = threading.Event(), threading.Event()
    delivered: list[KVEvent] = []
    most_queued = 0

    def listener(event: KVEvent) -> None:
        stuck.set()
        gate.wait()
        delivered.append(event)

    engine.add_event_listener(listener)
    first = threading.Thread(target=tier.put, args=([(key_for("first"), b"x")],))
    first.start()
    stuck.wait()  # the first put delivers its "stored", stuck in the listener

    def keep_putting() -> None:
        nonlocal most_queued
        for i in range(3 * bound):
            tier.put([(key_for(f"chunk{i}"), b"x")])
            most_queued = max(most_queued, events.queued() if hasattr(events, "queued") else len(events._queue))

    putter = threading.Thread(target=keep_putting)
    putter.start()
    # Until the putter finished (ee9bb23) or waits for room (the bound): no timing involved.
    while putter.is_alive() and getattr(events, "waits", 0) == 0:
        time.sleep(0.01)
    gate.set()
    putter.join()
    first.join()
    assert most_queued <= bound + 1  # ee9bb23: 3 * bound, every put's event queued behind the stuck one
    assert [e.keys[0] for e in delivered if e.kind == "stored"] == [key_for("first")] + [
        key_for(f"chunk{i}") for i in range(3 * bound)
    ]  # all of them, in order


def test_the_delivering_thread_never_waits_on_itself() -> None:
    """A listener that calls its tier back queues events on the delivering thread: it must not
    wait for a queue only it can drain, even past the bound."""
    sent: list[KVEvent] = []
    events = OrderedEvents(lambda e: on_event(e), max_queued=1)

    def on_event(event: KVEvent) -> None:
        sent.append(event)
        if len(sent) == 1:
            for i in range(5):
                events.add(KVEvent("stored", (f"k{i}",), tier="cpu"))
                events.deliver()  # returns at once: this thread is the one delivering

    events.add(KVEvent("stored", ("first",), tier="cpu"))
    events.deliver()
    assert [e.keys[0] for e in sent] == ["first"] + [f"k{i}" for i in range(5)] and events.waits == 0


def test_the_bound_must_be_usable() -> None:
    with pytest.raises(ValueError, match="max_queued >= 1"):
        OrderedEvents(lambda e: None, max_queued=0)


def test_a_listener_stuck_for_good_costs_one_timed_out_wait_not_one_per_call(monkeypatch) -> None:
    """With the delivering thread stuck in a listener, every call that found more than
    ``max_queued`` events queued waited the whole drain wait (on a179627: 30 s each, a draining
    close of B batches B x 30 s). After one timed-out wait, no call waits again until the
    delivering thread sent an event: then one may wait again."""
    import kvplug.core.events as events_module

    monkeypatch.setattr(events_module, "_DRAIN_WAIT_S", 0.05)  # each wait times out (the listener is gated)
    gates = {"first": threading.Event(), "k4": threading.Event()}
    stuck = {key: threading.Event() for key in gates}
    sent: list[str] = []

    def listener(event: KVEvent) -> None:
        key = event.keys[0]
        if key in gates:
            stuck[key].set()
            assert gates[key].wait(60), "the test's gate was never opened"
        sent.append(key)

    events = OrderedEvents(listener, max_queued=1)
    events.add(KVEvent("stored", ("first",), tier="cpu"))
    deliverer = threading.Thread(target=events.deliver)
    deliverer.start()
    try:
        assert stuck["first"].wait(60)
        for i in range(5):  # past the bound from the second on: one wait times out, the rest do not wait
            events.add(KVEvent("stored", (f"k{i}",), tier="cpu"))
            events.deliver()
        assert events.waits == 1  # a179627: 4, each past the bound waited it out
        assert events.waits_skipped == 3
        gates["first"].set()  # the deliverer moves on, then sticks on k4
        assert stuck["k4"].wait(60)
        for i in range(5, 9):
            events.add(KVEvent("stored", (f"k{i}",), tier="cpu"))
            events.deliver()
        assert (events.waits, events.waits_skipped) == (2, 5)  # it made progress: one wait more
    finally:
        for gate in gates.values():
            gate.set()
        deliverer.join(60)
    assert not deliverer.is_alive()
    assert sent == ["first"] + [f"k{i}" for i in range(9)]
