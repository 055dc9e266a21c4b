"""Tiers ``disk`` and ``shm`` report their events in the order of their changes: a put whose
``stored`` another thread is still delivering, and a racing put that evicts its record
(:func:`kvplug.testing.event_order.check_events_follow_state_changes`, real threads and gates)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvplug import KVEvent, StorageTier
from kvplug.testing import key_for, tier_context, value_for
from kvplug.testing.event_order import GATE_TIMEOUT_S, check_events_follow_state_changes
from kvplug_disk import DiskTier, ShmTier


@pytest.mark.parametrize("tier_class", [DiskTier, ShmTier])
def test_a_racing_eviction_is_heard_after_the_stored_it_follows(
    tier_class: type[DiskTier] | type[ShmTier], tmp_path: Path, shm_dir: Path
) -> None:
    folder = (tmp_path if tier_class is DiskTier else shm_dir) / "cache"

    def make(max_bytes: int, listener: Callable[[KVEvent], None]) -> StorageTier:
        config = tier_class.Config(path=folder, max_bytes=max_bytes, scan_on_start=False)
        return tier_class(config, tier_context(emit=listener))

    check_events_follow_state_changes(make)


@pytest.mark.parametrize("again", [False, True], ids=["new", "written-again"])
def test_a_record_evicted_before_its_put_indexed_it_is_never_announced(tmp_path: Path, again: bool) -> None:
    """The disk tier keeps its budget in its folder: a racing put may evict a record between
    its own put's write and that put's indexing of it (held here at a gate after the write).
    That put must not index it nor announce it ``stored``: it is gone, and its eviction was
    reported before (not at all when it was not indexed yet). ``written-again``: the first put
    writes a record already held (indexed) again."""
    told: list[tuple[str, tuple[str, ...]]] = []
    tier = DiskTier(
        DiskTier.Config(path=tmp_path / "cache", max_bytes=1500, scan_on_start=False),
        tier_context(emit=lambda event: told.append((event.kind, event.keys))),
    )
    first, second = key_for("first"), key_for("second")
    if again:
        tier.put([(first, value_for("first", 1000))])
        told.clear()
    written, release = threading.Event(), threading.Event()
    real_batch = tier._batch

    def batch(operation: Any, arguments: Any) -> Any:
        results = real_batch(operation, arguments)
        if threading.current_thread().name == "put-first" and not written.is_set():
            written.set()  # the first put's record is written, not yet indexed
            release.wait(GATE_TIMEOUT_S)
        return results

    tier._batch = batch  # type: ignore[method-assign]
    putter = threading.Thread(target=tier.put, args=([(first, value_for("first", 1000))],), name="put-first")
    putter.start()
    try:
        assert written.wait(GATE_TIMEOUT_S)
        tier.put([(second, value_for("second", 1000))])  # the folder's budget evicts the first
    finally:
        release.set()
        putter.join(GATE_TIMEOUT_S)
    # (a lookup of the first would find it gone: too late)
    assert told == [("stored", (second,))] + ([("evicted", (first,))] if again else []), told
    assert tier.stats().items == 1
    assert tier.contains([first, second]) == [False, True]
    tier.close()
