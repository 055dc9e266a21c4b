"""Tier ``cpu``'s pins and per-tenant quotas, on real tiers."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from pydantic import ValidationError

from kvplug import TierChain, TierContext
from kvplug.core.pins import pin_keys, unpin_keys
from kvplug.testing import value_for
from kvplug_cpu import CPUTier

CHUNK = 100
TENANTS = ("tenant-a", "tenant-b", "tenant-c", None)


def fingerprint_of(tenant: str | None) -> str:
    return hashlib.sha256(f"fp/{tenant}".encode()).hexdigest()[:32]


def key_of(tenant: str | None, name: str) -> str:
    return f"v1/{fingerprint_of(tenant)}/{hashlib.sha256(name.encode()).hexdigest()}"


def make_tier(eviction: str = "lru", **options: object) -> tuple[CPUTier, TierContext]:
    context = TierContext()
    for tenant in TENANTS:
        context.tenancy.tenants.note(fingerprint_of(tenant), tenant)
    config = CPUTier.Config(eviction=eviction, **{"max_bytes": 10 * CHUNK, **options})  # type: ignore[arg-type]
    return CPUTier(config, context), context


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_pinned_system_prompt_survives_a_scan(eviction: str) -> None:
    tier, context = make_tier(eviction, pin_max_bytes="30%")
    system = [key_of(None, f"system-{i}") for i in range(3)]
    context.tenancy.pins.add(system)  # as CacheEngine.pin does before the prompt is stored
    tier.put([(key, value_for(key, CHUNK)) for key in system])
    warm = [key_of(None, f"warm-{i}") for i in range(3)]
    tier.put([(key, value_for(key, CHUNK)) for key in warm])
    scan = [key_of(None, f"one-off-{i}") for i in range(200)]
    for key in scan:
        tier.put([(key, value_for(key, CHUNK))])
    assert tier.contains(system) == [True] * 3
    assert tier.get(system) == [value_for(key, CHUNK) for key in system]
    assert tier.contains(warm) == [False] * 3  # everything else was evicted
    assert tier.stats().bytes_used <= 10 * CHUNK
    assert tier.stats().extra["pinned_bytes"] == 3 * CHUNK


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


def test_a_pin_over_the_pin_budget_is_refused_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    tier, context = make_tier(pin_max_bytes=2 * CHUNK)
    chain = TierChain([tier])
    chain.tenancy = context.tenancy
    keys = [key_of(None, f"k{i}") for i in range(3)]
    tier.put([(key, value_for(key, CHUNK)) for key in keys])
    report = pin_keys(chain, keys)
    assert (report.chunks, report.refused, report.missing) == (2, 1, 0)
    assert tier.stats().extra["pins_refused"] == 1
    assert tier.stats().extra["pinned_bytes"] == 2 * CHUNK
    assert "refused" in caplog.text and "pin_max_bytes" in caplog.text


def test_a_tenant_over_its_quota_evicts_its_own_chunks_not_another_s() -> None:
    tier, context = make_tier(quotas={"tenant-a": 3 * CHUNK, "default": "20%"})
    mine_b = [key_of("tenant-b", f"b{i}") for i in range(2)]
    tier.put([(key, value_for(key, CHUNK)) for key in mine_b])
    first_a = [key_of("tenant-a", f"a{i}") for i in range(3)]
    tier.put([(key, value_for(key, CHUNK)) for key in first_a])
    for i in range(3, 20):  # tenant-a floods: far past its quota, well within the tier's budget
        key = key_of("tenant-a", f"a{i}")
        tier.put([(key, value_for(key, CHUNK))])
    assert tier.contains(mine_b) == [True, True]  # older than every chunk of tenant-a, still there
    assert tier.contains(first_a) == [False] * 3
    extra = tier.stats().extra
    label = context.tenancy.labels.label("tenant-a", {"tenant-a"})  # a quota named by its salt: a digest label
    assert label.startswith("salt-") and not any("tenant-a" in key for key in extra)
    assert extra[f"tenant_bytes:{label}"] == 3 * CHUNK
    assert extra["tenant_bytes:(other)"] == 2 * CHUNK  # tenant-b: not named, one bounded label
    assert extra["quota_evictions"] == 17


def test_unpinned_chunks_put_their_tenant_over_its_quota_at_once() -> None:
    tier, _ = make_tier(pin_max_bytes="30%", quotas={"tenant-a": 3 * CHUNK})
    keys = [key_of("tenant-a", f"a{i}") for i in range(4)]
    tier.put([(keys[0], value_for(keys[0], CHUNK))])
    assert tier.pin([keys[0]]) == [("pinned", CHUNK)]
    tier.put([(key, value_for(key, CHUNK)) for key in keys[1:]])  # the quota, beside the pinned one
    tier.unpin([keys[0]])  # now 4 chunks count against a quota of 3: the oldest unpinned one goes
    assert tier.contains(keys) == [True, False, True, True]
    assert tier.stats().extra["quota_evictions"] == 1


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
            own = policy._own.get(tenant) if tenant is not None else None
            if own is not None:
                quota = 4 * CHUNK if tenant == "tenant-a" else 3 * CHUNK
                assert own.bytes_used + requested <= quota, (tenant, own.bytes_used, requested)


class PinsAndQuotasS3FIFO(PinsAndQuotas):
    eviction = "s3fifo"


TestPinsAndQuotasLRU = PinsAndQuotas.TestCase
TestPinsAndQuotasLRU.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
TestPinsAndQuotasS3FIFO = PinsAndQuotasS3FIFO.TestCase
TestPinsAndQuotasS3FIFO.settings = settings(max_examples=40, stateful_step_count=60, deadline=None)
