"""Tier ``cpu``'s pins and per-tenant quotas, on real tiers: kvplug's contract suite, and the cpu tier's own cases."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from pydantic import ValidationError

from kvplug import TierChain, TierContext
from kvplug.core.pins import pin_keys, unpin_keys
from kvplug.testing import PinsAndQuotasContract, pins_context, value_for
from kvplug.testing.pins_contract import TENANTS, key_of
from kvplug_cpu import CPUTier

CHUNK = 100


def make_tier(eviction: str = "lru", **options: object) -> tuple[CPUTier, TierContext]:
    context = pins_context()
    config = CPUTier.Config(eviction=eviction, **{"max_bytes": 10 * CHUNK, **options})  # type: ignore[arg-type]
    return CPUTier(config, context), context


class TestCPUPinsAndQuotas(PinsAndQuotasContract):
    value = unit = CHUNK

    @pytest.fixture
    def make_tier(self) -> Callable[..., tuple[CPUTier, TierContext]]:
        return make_tier


def test_pin_of_a_stored_chunk_through_the_chain_and_unpin() -> None:
    tier, context = make_tier("s3fifo", pin_max_bytes="30%")
    chain = TierChain([tier])
    chain.tenancy = context.tenancy
    stored = [key_of("tenant-a", f"p{i}") for i in range(2)]
    tier.put([(key, value_for(key, CHUNK)) for key in stored])
    later = key_of("tenant-a", "p2")
    report = pin_keys(chain, [*stored, later])
    assert (report.chunks, report.bytes, report.refused, report.missing) == (2, 2 * CHUNK, 0, 1)
    tier.put([(later, value_for(later, CHUNK))])  # pinned as it is stored
    for i in range(100):
        tier.put([(key_of(None, f"scan-{i}"), value_for(str(i), CHUNK))])
    assert tier.contains([*stored, later]) == [True] * 3
    report = unpin_keys(chain, [*stored, later])
    assert (report.chunks, report.bytes) == (3, 3 * CHUNK)
    for i in range(100, 200):
        tier.put([(key_of(None, f"scan-{i}"), value_for(str(i), CHUNK))])
    assert tier.contains([*stored, later]) == [False] * 3


def test_a_request_pin_that_grows_counts_against_its_tenant_s_quota() -> None:
    tier, context = make_tier(request_pin_max_bytes="20%", quotas={"tenant-a": 3 * CHUNK})
    pinned, other = key_of("tenant-a", "pinned"), key_of("tenant-a", "other")
    context.tenancy.pins.add([pinned], requested=True)
    tier.put([(pinned, value_for(pinned, 10)), (other, value_for(other, 2 * CHUNK))])
    tier.put([(pinned, value_for(pinned, 2 * CHUNK))])  # still within request_pin_max_bytes: 4 chunks in all
    assert tier.stats().extra["request_pinned_bytes"] == 2 * CHUNK
    assert tier.contains([pinned, other]) == [True, False]  # the tenant gave up its unpinned chunk


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"quotas": {"tenant-a": "120%"}}, ["quotas['tenant-a']", "120%", "at most 100"]),
        ({"quotas": {"tenant-a": "2KiB"}}, ["quotas['tenant-a']", "2048", "max_bytes (1000)"]),
        ({"quotas": {"default": "lots"}}, ["quotas['default']", "'lots'", "byte size"]),
        ({"pin_max_bytes": 5000}, ["pin_max_bytes", "5000", "max_bytes (1000)"]),
    ],
)
def test_bad_quotas_name_the_field_the_value_and_the_bound(options: dict[str, object], words: list[str]) -> None:
    with pytest.raises(ValidationError) as caught:
        CPUTier.Config(max_bytes=1000, **options)  # type: ignore[arg-type]
    for word in words:
        assert word in str(caught.value)


class PinsAndQuotas(RuleBasedStateMachine):
    """Random puts, gets, pins and unpins across tenants on a real cpu tier."""

    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.quotas = {"tenant-a": 4 * CHUNK, "default": "30%"}
        self.tier, self.context = make_tier(
            self.eviction, pin_max_bytes=5 * CHUNK, request_pin_max_bytes=2 * CHUNK, quotas=self.quotas
        )
        self.chain = TierChain([self.tier])
        self.chain.tenancy = self.context.tenancy
        self.pinned: set[str] = set()
        self.evicted: list[str] = []  # keys evicted while pinned
        self.context.emit = lambda event: (
            self.evicted.extend(set(event.keys) & self.pinned) if event.kind == "evicted" else None
        )

    names = st.integers(min_value=0, max_value=40).map(str)
    tenants = st.sampled_from(TENANTS)
    sizes = st.integers(min_value=1, max_value=2 * CHUNK)

    @rule(tenant=tenants, name=names, size=sizes)
    def put(self, tenant: str | None, name: str, size: int) -> None:
        key = key_of(tenant, name)
        self.pinned.discard(key)  # stored again larger past a pin budget, a pinned chunk becomes an ordinary one
        self.tier.put([(key, value_for(key, size))])
        if self.tier._policy.is_pinned(key):
            self.pinned.add(key)

    @rule(tenant=tenants, name=names)
    def get(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        value = self.tier.get([key])[0]
        assert value is None or bytes(value) == value_for(key, len(value))

    @rule(tenant=tenants, name=names)
    def pin(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        outcome, _ = self.tier.pin([key])[0]
        if outcome in ("pinned", "already"):
            self.pinned.add(key)

    @rule(tenant=tenants, name=names)
    def request_pin(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        if pin_keys(self.chain, [key], requested=True).chunks:
            self.pinned.add(key)

    @rule(tenant=tenants, name=names)
    def operator_pin(self, tenant: str | None, name: str) -> None:  # may turn request pins into ordinary chunks
        key = key_of(tenant, name)
        if pin_keys(self.chain, [key]).chunks:
            self.pinned.add(key)
        self.pinned = {key for key in self.pinned if self.tier._policy.is_pinned(key)}

    @rule(tenant=tenants, name=names)
    def unpin(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        self.tier.unpin([key])
        self.pinned.discard(key)

    @invariant()
    def budgets_hold_and_pins_stay(self) -> None:
        stats = self.tier.stats()
        assert stats.bytes_used <= 10 * CHUNK
        assert stats.extra["pinned_bytes"] <= 5 * CHUNK
        assert not self.pinned & set(self.evicted), "a pinned chunk was evicted"
        assert all(self.tier.contains(sorted(self.pinned)))
        policy = self.tier._policy  # the quotas count unpinned bytes and request pins: read them where they are kept
        for tenant in TENANTS:
            requested = policy._pinned.requested_of(tenant)
            assert requested <= 2 * CHUNK, (tenant, requested)  # request_pin_max_bytes, per tenant
            own = policy._tenants.own.get(tenant) if tenant is not None else None
            if own is not None:
                quota = 4 * CHUNK if tenant == "tenant-a" else 3 * CHUNK
                assert own.bytes_used + requested <= quota, (tenant, own.bytes_used, requested)


class PinsAndQuotasS3FIFO(PinsAndQuotas):
    eviction = "s3fifo"


TestPinsAndQuotasLRU = PinsAndQuotas.TestCase
TestPinsAndQuotasLRU.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
TestPinsAndQuotasS3FIFO = PinsAndQuotasS3FIFO.TestCase
TestPinsAndQuotasS3FIFO.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
