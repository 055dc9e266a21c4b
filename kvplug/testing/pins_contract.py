"""``PinsAndQuotasContract``: pins and per-tenant quotas of a tier that keeps them.

For a tier built on :class:`~kvplug.GuardedEviction` (``TenancySettings`` in its
``Config``): a pinned prompt outlives a scan, a pin past ``pin_max_bytes`` is refused and
counted, a tenant over its quota evicts its own values and nobody else's, and unpinning
puts a tenant over its quota at once. Subclass it in your tests::

    class TestMyTierPins(PinsAndQuotasContract):
        unit = 1000 + 64  # what one stored value of VALUE bytes counts (value and header)

        @pytest.fixture
        def make_tier(self, tmp_path) -> MakeTier:
            def make(eviction="lru", **options):
                context = pins_context()
                config = MyTier.Config(path=tmp_path, eviction=eviction, max_bytes=10 * self.unit, **options)
                return MyTier(config, context), context
            return make

The tier's budget must hold ten values (``10 * unit``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import pytest

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.pins import pin_keys
from kvplug.core.tier import StorageTier, TierContext
from kvplug.testing.storage_contract import value_for

#: The tenants (cache_salts) of the contract's keys; ``None``: no salt.
TENANTS = ("tenant-a", "tenant-b", "tenant-c", None)
#: ``make_tier(eviction, **options) -> (tier, its context)``: a tier of ``10 * unit`` bytes.
MakeTier = Callable[..., "tuple[StorageTier, TierContext]"]


def fingerprint_of(tenant: str | None) -> str:
    """The key fingerprint of one tenant's engine."""
    return hashlib.sha256(f"fp/{tenant}".encode()).hexdigest()[:32]


def key_of(tenant: str | None, name: str) -> str:
    """An engine-shaped key of ``tenant``."""
    return f"v1/{fingerprint_of(tenant)}/{hashlib.sha256(name.encode()).hexdigest()}"


def pins_context(context: TierContext | None = None) -> TierContext:
    """A tier context whose tenancy knows the tenant of every contract key."""
    context = context or TierContext()
    for tenant in TENANTS:
        context.tenancy.tenants.note(fingerprint_of(tenant), tenant)
    return context


class PinsAndQuotasContract:
    """Pins and quotas on a real tier. Subclass with ``make_tier`` and, where a stored value
    counts more than its bytes (a record header), ``unit``."""

    #: Bytes of one value the contract stores.
    value: ClassVar[int] = 100
    #: What one stored value counts against budgets, pins and quotas.
    unit: ClassVar[int] = 100

    @pytest.fixture
    def make_tier(self) -> MakeTier:
        raise NotImplementedError

    @pytest.fixture
    def open_tier(self, make_tier: MakeTier) -> Iterator[Callable[..., tuple[StorageTier, TierContext]]]:
        opened: list[StorageTier] = []

        def open_one(eviction: str = "lru", **options: Any) -> tuple[StorageTier, TierContext]:
            tier, context = make_tier(eviction, **options)
            opened.append(tier)
            return tier, context

        yield open_one
        for tier in opened:
            tier.close()

    def put(self, tier: StorageTier, keys: list[str]) -> None:
        tier.put([(key, value_for(key, self.value)) for key in keys])

    @pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
    def test_pinned_system_prompt_survives_a_scan(self, open_tier: Any, eviction: str) -> None:
        tier, context = open_tier(eviction, pin_max_bytes="40%")
        system = [key_of(None, f"system-{i}") for i in range(3)]
        context.tenancy.pins.add(system)  # as CacheEngine.pin does before the prompt is stored
        self.put(tier, system)
        warm = [key_of(None, f"warm-{i}") for i in range(3)]
        self.put(tier, warm)
        for i in range(60):
            self.put(tier, [key_of(None, f"one-off-{i}")])
        assert [None if v is None else bytes(v) for v in tier.get(system)] == [value_for(k, self.value) for k in system]
        assert tier.contains(warm) == [False] * 3  # everything else was evicted
        assert tier.stats().extra["pinned_bytes"] == 3 * self.unit

    def test_a_pin_over_the_pin_budget_is_refused_and_counted(
        self, open_tier: Any, caplog: pytest.LogCaptureFixture
    ) -> None:
        tier, context = open_tier(pin_max_bytes=2 * self.unit)
        chain = TierChain([tier])
        chain.tenancy = context.tenancy
        keys = [key_of(None, f"k{i}") for i in range(3)]
        self.put(tier, keys)
        report = pin_keys(chain, [*keys, key_of(None, "not stored")])
        assert (report.chunks, report.bytes, report.refused, report.missing) == (2, 2 * self.value, 1, 1)
        assert tier.stats().extra["pins_refused"] == 1
        assert tier.stats().extra["pinned_bytes"] == 2 * self.unit
        assert "refused" in caplog.text

    def test_a_tenant_over_its_quota_evicts_its_own_values_not_another_s(self, open_tier: Any) -> None:
        tier, context = open_tier(quotas={"tenant-a": 3 * self.unit, "default": "25%"})
        mine_b = [key_of("tenant-b", f"b{i}") for i in range(2)]
        self.put(tier, mine_b)
        first_a = [key_of("tenant-a", f"a{i}") for i in range(3)]
        self.put(tier, first_a)
        for i in range(3, 20):  # tenant-a floods: far past its quota, well within the tier's budget
            self.put(tier, [key_of("tenant-a", f"a{i}")])
        assert tier.contains(mine_b) == [True, True]  # older than every value of tenant-a, still there
        assert tier.contains(first_a) == [False] * 3
        extra = tier.stats().extra
        label = context.tenancy.labels.label("tenant-a", {"tenant-a"})  # a quota named by its salt: a digest label
        assert label.startswith("salt-") and not any("tenant-a" in key for key in extra)
        assert extra[f"tenant_bytes:{label}"] == 3 * self.unit
        assert extra["tenant_bytes:(other)"] == 2 * self.unit  # tenant-b: not named, one bounded label
        assert extra["quota_evictions"] == 17

    def test_unpinned_values_put_their_tenant_over_its_quota_at_once(self, open_tier: Any) -> None:
        tier, _ = open_tier(pin_max_bytes="30%", quotas={"tenant-a": 3 * self.unit})
        keys = [key_of("tenant-a", f"a{i}") for i in range(4)]
        self.put(tier, keys[:1])
        assert tier.pin([keys[0]]) == [("pinned", self.value)]
        self.put(tier, keys[1:])  # the quota, beside the pinned one
        tier.unpin([keys[0]])  # now 4 values count against a quota of 3: the oldest unpinned one goes
        assert tier.contains(keys) == [True, False, True, True]
        assert tier.stats().extra["quota_evictions"] == 1
