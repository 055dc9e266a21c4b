"""The lookup budget bounds lookups only: a load of what a lookup found is not cut by it."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvplug import TierChain, TierContext
from kvplug.core.remote.calls import remaining_budget_s
from kvplug_cpu import CPUTier


class SlowAnsweringTier(CPUTier):
    """A real cpu tier that takes 50 ms to answer ``contains`` and, like every remote
    tier (kvplug.core.remote.calls.RemoteCalls), answers "miss" once the caller's budget is spent."""

    name = "slow-cpu"

    def contains(self, keys: Sequence[str]) -> list[bool]:
        time.sleep(0.05)
        remaining = remaining_budget_s()
        if remaining is not None and remaining <= 0:
            return [False] * len(keys)
        return super().contains(keys)


def test_lookups_stop_at_the_budget_but_loads_fetch_everything_found() -> None:
    tier = SlowAnsweringTier(SlowAnsweringTier.Config(), TierContext())
    chain = TierChain([tier], lookup_timeout_s=0.01)
    keys = [f"v1/{'ab' * 8}/{i:064x}" for i in range(4)]
    chain.put([(key, key.encode()) for key in keys])
    try:
        assert chain.contains_prefix(keys) == 0  # the lookup ran past its 10 ms budget
        assert [bytes(hit.value) for hit in chain.fetch_prefix(keys)] == [key.encode() for key in keys]
    finally:
        chain.close()


def test_a_lookup_within_its_budget_finds_the_prefix() -> None:
    tier = SlowAnsweringTier(SlowAnsweringTier.Config(), TierContext())
    chain = TierChain([tier], lookup_timeout_s=5.0)
    keys = [f"v1/{'cd' * 8}/{i:064x}" for i in range(3)]
    chain.put([(key, b"x") for key in keys[:2]])
    try:
        assert chain.contains_prefix(keys) == 2
    finally:
        chain.close()
