"""Tiers ``disk`` and ``shm`` report their events in the order of their changes: a put whose
``stored`` another thread is still delivering, and a racing put that evicts its record
(:func:`kvplug.testing.event_order.check_events_follow_state_changes`, real threads and gates)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from kvplug import KVEvent, StorageTier
from kvplug.testing import tier_context
from kvplug.testing.event_order import check_events_follow_state_changes
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
