"""A check that a tier's events reach a listener in the order its state changed, with real
threads: a put whose ``stored`` listener is held at a gate while a second put evicts its key.
Routers replay events in the order they hear them: an ``evicted`` heard before the matching
``stored`` leaves one believing a chunk is held that is gone."""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvplug.core.events import KVEvent
from kvplug.core.tier import StorageTier
from kvplug.testing.storage_contract import key_for, value_for

#: Bound of each wait on a gate: a tier that never lets the other thread on fails the check, never hangs it.
GATE_TIMEOUT_S = 30.0

#: Makes a tier with the ``max_bytes`` given, reporting its events to the listener given.
MakeTier = Callable[[int, Callable[[KVEvent], None]], StorageTier]


def check_events_follow_state_changes(make_tier: MakeTier, value_bytes: int = 1000) -> None:
    """Put ``first`` on a thread whose delivery of its ``stored`` is held at a gate; meanwhile
    put ``second``, which leaves room for one value only and so evicts ``first``; then open
    the gate. The listener must hear ``stored first``, ``stored second``, ``evicted first``:
    the order of the tier's changes, whichever thread delivers them."""
    first, second = key_for("order-first"), key_for("order-second")
    heard: list[tuple[str, tuple[str, ...]]] = []
    held, release = threading.Event(), threading.Event()

    def listener(event: KVEvent) -> None:
        if event.kind == "stored" and first in event.keys and not held.is_set():
            held.set()
            release.wait(GATE_TIMEOUT_S)
        heard.append((event.kind, event.keys))

    tier = make_tier(value_bytes * 3 // 2, listener)
    try:
        failures: list[BaseException] = []

        def put_first() -> None:
            try:
                tier.put([(first, value_for("order-first", value_bytes))])
            except BaseException as exc:  # reported by the check, not lost with the thread
                failures.append(exc)

        putter = threading.Thread(target=put_first, name="put-first")
        putter.start()
        assert held.wait(GATE_TIMEOUT_S), "the first put never announced its chunk"
        # The second put must not wait for the first one's listener: it returns, leaving its
        # events to the thread delivering (a tier whose put waited would fail here).
        tier.put([(second, value_for("order-second", value_bytes))])
        assert tier.contains([first, second]) == [False, True]
        release.set()
        putter.join(GATE_TIMEOUT_S)
        assert not putter.is_alive() and failures == []
        tier.flush()
        names = {first: "first", second: "second"}
        told = [(kind, tuple(names.get(key, key) for key in keys)) for kind, keys in heard]
        assert told == [("stored", ("first",)), ("stored", ("second",)), ("evicted", ("first",))], told
    finally:
        release.set()
        tier.close()
