"""GuardedEviction: the policy wrapper behind the tiers' pins and quotas."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug import GuardedEviction


def test_a_pinned_key_stored_again_past_the_pin_budget_becomes_evictable() -> None:
    guard = GuardedEviction("lru", pin_budget=100)
    guard.inserted("a", 50)
    assert guard.pin("a") == "pinned"
    guard.inserted("a", 80)  # larger, still within the budget: still pinned
    assert guard.is_pinned("a") and guard.pinned_bytes == 80
    guard.inserted("b", 10)
    assert guard.pin("b") == "pinned"
    guard.inserted("a", 95)  # 10 + 95 > 100
    assert not guard.is_pinned("a")
    assert (guard.pinned_bytes, guard.pins_refused) == (10, 1)
    assert guard.pop_victim() == ("a", 95)
    assert guard.pop_victim() is None  # b stays: pinned


OPS = st.lists(
    st.tuples(
        st.sampled_from(["insert", "access", "remove", "pin", "unpin", "evict"]),
        st.integers(min_value=0, max_value=15),
        st.integers(min_value=1, max_value=40),
    ),
    max_size=200,
)


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_random_workloads_keep_pins_budgets_and_quotas(eviction: str, ops: list[tuple[str, int, int]]) -> None:
    tenants = {f"k{i}": ("t-a" if i % 3 == 0 else "t-b" if i % 3 == 1 else None) for i in range(16)}
    guard = GuardedEviction(
        eviction,
        pin_budget=60,
        quotas={"t-a": 50},
        default_quota=70,
        tenant_of=tenants.get,
        wants_pin=lambda k: k == "k5",
    )
    held: dict[str, int] = {}  # what the owner holds: key -> size
    for op, i, size in ops:
        key = f"k{i}"
        if op == "insert":
            guard.inserted(key, size)
            held[key] = size
            for victim, victim_size in guard.take_over_quota():
                assert tenants[victim] == tenants[key], "a quota evicted another tenant's key"
                assert not guard.is_pinned(victim)
                assert held.pop(victim) == victim_size
        elif op == "access":
            guard.accessed(key)
        elif op == "remove":
            guard.removed(key)
            held.pop(key, None)
        elif op == "pin":
            assert (guard.pin(key) == "missing") == (key not in held)
        elif op == "unpin":
            guard.unpin(key)
        else:
            victim = guard.pop_victim()
            if victim is not None:
                assert not guard.is_pinned(victim[0])
                assert held.pop(victim[0]) == victim[1]
        pinned = {k for k in held if guard.is_pinned(k)}
        assert guard.pinned_bytes == sum(held[k] for k in pinned) <= 60
        assert len(guard) == len(held) and guard.bytes_used == sum(held.values())
        for tenant, quota in (("t-a", 50), ("t-b", 70)):
            unpinned = sum(s for k, s in held.items() if tenants[k] == tenant and k not in pinned)
            assert op != "insert" or tenants[key] != tenant or unpinned <= quota
