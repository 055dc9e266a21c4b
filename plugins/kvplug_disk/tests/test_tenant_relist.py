"""How often a folder tier with quotas lists its folder while an older kvplug writing beside it
keeps the tenant table stale: a listing holds the folder's lock (2-3 s at 100k records,
benchmarks/bench_folder_open.py), so it is repeated only once 20 times its own time has passed
(and 10 s at least): listing takes under 5% of the lock's time, however large the folder.

Time is a stepping clock (:data:`kvplug_disk.budget.clock`), never the wall: every reading of it
is ``step`` seconds after the one before, so a listing (timed by a reading before and after it)
takes ``step``. Whether a write listed the folder is read from the folder itself: a listing
writes a valid tenant table into the ledger, which the older kvplug's next write makes stale.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path

import pytest
from test_folder_quotas import ledger_of, open_tier, put, tenant_keys

from kvplug_disk import budget
from kvplug_disk.ledger import LEDGER_NAME


class SteppingClock:
    """A monotonic clock each reading of which is ``step`` seconds after the one before."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def older_kvplug_writes(folder: Path) -> None:
    """What an older kvplug's write does to the ledger: its total alone, which makes the table stale."""
    with (folder / LEDGER_NAME).open("r+b") as file:
        file.write((int.from_bytes(file.read(8), "little") + 1).to_bytes(8, "little"))


def listing_times(kind: str, folder: Path, clock: SteppingClock, writes: int) -> list[float]:
    """The clock's readings after each of ``writes`` writes (each after an older kvplug's) that listed the folder."""
    tier = open_tier(kind, folder)  # its open lists the folder
    listed = []
    try:
        for i in range(writes):
            older_kvplug_writes(folder)
            put(tier, tenant_keys(f"w{i}", "tenant-a", 1))
            if ledger_of(folder)[1] is not None:  # listed: a valid table again
                listed.append(clock.now)
    finally:
        tier.close()
    return listed


def test_a_slow_listing_is_repeated_only_after_twenty_times_its_time(
    kind: str, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppingClock(step=3.0)  # a listing takes 3 s (about 100k records)
    monkeypatch.setattr(budget, "clock", clock)
    listed = listing_times(kind, folder, clock, writes=70)
    assert len(listed) >= 2, f"a stale table is listed again, at least now and then: {listed}"
    gaps = [later - earlier for earlier, later in pairwise(listed)]
    # from the end of one listing to the end of the next: at least 20 times its 3 s, then its own 3 s
    assert min(gaps) >= budget.TENANT_RELIST_COST_FACTOR * clock.step + clock.step, gaps


def test_a_quick_listing_is_repeated_after_the_least_interval(
    kind: str, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppingClock(step=0.4)  # a listing takes 0.4 s: 20 times that is under the least interval, 10 s
    monkeypatch.setattr(budget, "clock", clock)
    listed = listing_times(kind, folder, clock, writes=120)
    gaps = [later - earlier for earlier, later in pairwise(listed)]
    assert len(listed) >= 3, listed
    # listed again at the first write past 10 s (a write reads the clock once, a listing twice)
    least = budget.TENANT_RELIST_INTERVAL_S
    assert all(least <= gap <= least + 3 * clock.step for gap in gaps), gaps
