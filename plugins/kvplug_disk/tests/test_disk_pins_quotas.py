"""Tiers ``disk`` and ``shm``: pins and per-tenant quotas, on real folders."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplug import TierChain, TierContext, key_digest
from kvplug.core.pins import pin_keys
from kvplug.testing import value_for
from kvplug_disk import DiskTier
from kvplug_disk.shm import ShmTier

VALUE = 1000
FILE = VALUE + 64  # a record file: the value and its header; pins and quotas count file bytes
BUDGET = 10 * VALUE
TENANTS = ("tenant-a", "tenant-b", "tenant-c", None)


def fingerprint_of(tenant: str | None) -> str:
    return hashlib.sha256(f"fp/{tenant}".encode()).hexdigest()[:32]


def key_of(tenant: str | None, name: str) -> str:
    return f"v1/{fingerprint_of(tenant)}/{hashlib.sha256(name.encode()).hexdigest()}"


def make_tier(
    path: Path,
    eviction: str = "lru",
    context: TierContext | None = None,
    tier: type[DiskTier] = DiskTier,
    **options: object,
) -> tuple[DiskTier, TierContext]:
    context = context or TierContext()
    for tenant in TENANTS:
        context.tenancy.tenants.note(fingerprint_of(tenant), tenant)
    config = tier.Config(path=path, eviction=eviction, fsync=False, max_bytes=BUDGET, **options)  # type: ignore[arg-type]
    return tier(config, context), context


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_pinned_system_prompt_survives_a_scan(tmp_path: Path, eviction: str) -> None:
    tier, context = make_tier(tmp_path / "disk", eviction, pin_max_bytes="40%")
    system = [key_of(None, f"system-{i}") for i in range(3)]
    context.tenancy.pins.add(system)  # as CacheEngine.pin does before the prompt is stored
    tier.put([(key, value_for(key, VALUE)) for key in system])
    warm = [key_of(None, f"warm-{i}") for i in range(3)]
    tier.put([(key, value_for(key, VALUE)) for key in warm])
    for i in range(60):
        key = key_of(None, f"one-off-{i}")
        tier.put([(key, value_for(key, VALUE))])
    assert tier.contains(warm) == [False] * 3  # everything else was evicted
    assert [bytes(v) if v is not None else None for v in tier.get(system)] == [value_for(k, VALUE) for k in system]
    extra = tier.stats().extra
    assert extra["pinned_items"] == 3 and extra["pinned_bytes"] == 3 * FILE
    assert extra["folder_bytes"] <= BUDGET
    tier.close()


def test_shm_keeps_pins_too(tmp_path: Path) -> None:
    tier, context = make_tier(tmp_path / "shm", "s3fifo", tier=ShmTier, pin_max_bytes="40%")
    system = key_of("tenant-a", "system")
    tier.put([(system, value_for(system, VALUE))])
    chain = TierChain([tier])
    chain.tenancy = context.tenancy
    assert pin_keys(chain, [system]).chunks == 1
    for i in range(40):
        key = key_of(None, f"one-off-{i}")
        tier.put([(key, value_for(key, VALUE))])
    assert tier.contains([system]) == [True]
    tier.close()


def test_a_pin_over_the_pin_budget_is_refused_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier, context = make_tier(tmp_path / "disk", pin_max_bytes=2 * FILE)
    chain = TierChain([tier])
    chain.tenancy = context.tenancy
    keys = [key_of(None, f"k{i}") for i in range(3)]
    tier.put([(key, value_for(key, VALUE)) for key in keys])
    report = pin_keys(chain, [*keys, key_of(None, "not stored")])
    assert (report.chunks, report.bytes, report.refused, report.missing) == (2, 2 * VALUE, 1, 1)
    assert tier.stats().extra["pins_refused"] == 1
    assert "refused" in caplog.text
    tier.close()


def test_configured_pins_apply_to_records_found_at_start(tmp_path: Path) -> None:
    first, _ = make_tier(tmp_path / "disk")
    system = key_of("tenant-a", "system")
    first.put([(system, value_for(system, VALUE))])
    first.close()
    context = TierContext()
    context.tenancy.pins.add([system])  # what the engine's config pins did before the tiers opened
    tier, _ = make_tier(tmp_path / "disk", context=context)
    assert tier.stats().extra["pinned_items"] == 1
    for i in range(40):
        key = key_of(None, f"one-off-{i}")
        tier.put([(key, value_for(key, VALUE))])
    assert tier.contains([system]) == [True]
    tier.close()


def test_a_tenant_over_its_quota_evicts_its_own_records_not_another_s(tmp_path: Path) -> None:
    tier, context = make_tier(tmp_path / "disk", quotas={"tenant-a": 3 * FILE, "default": "25%"})
    mine_b = [key_of("tenant-b", f"b{i}") for i in range(2)]
    tier.put([(key, value_for(key, VALUE)) for key in mine_b])
    first_a = [key_of("tenant-a", f"a{i}") for i in range(3)]
    tier.put([(key, value_for(key, VALUE)) for key in first_a])
    for i in range(3, 20):  # far past tenant-a's quota, within the folder's budget each time
        key = key_of("tenant-a", f"a{i}")
        tier.put([(key, value_for(key, VALUE))])
    assert tier.contains(mine_b) == [True, True]
    assert tier.contains(first_a) == [False] * 3
    extra = tier.stats().extra
    label = context.tenancy.labels.label("tenant-a", {"tenant-a"})  # a quota named by its salt: a digest label
    assert label.startswith("salt-") and not any("tenant-a" in key for key in extra)
    assert extra[f"tenant_bytes:{label}"] == 3 * FILE
    assert extra["tenant_bytes:(other)"] == 2 * FILE
    assert extra["quota_evictions"] == 17
    tier.close()


def test_unpinned_records_put_their_tenant_over_its_quota_at_once(tmp_path: Path) -> None:
    tier, _ = make_tier(tmp_path / "disk", pin_max_bytes="30%", quotas={"tenant-a": 3 * FILE})
    keys = [key_of("tenant-a", f"a{i}") for i in range(4)]
    tier.put([(keys[0], value_for(keys[0], VALUE))])
    assert tier.pin([keys[0]]) == [("pinned", VALUE)]
    tier.put([(key, value_for(key, VALUE)) for key in keys[1:]])  # the quota, beside the pinned one
    tier.unpin([keys[0]])  # now 4 records count against a quota of 3: the oldest unpinned one goes
    assert tier.contains(keys) == [True, False, True, True]
    assert tier.stats().extra["quota_evictions"] == 1
    tier.close()


class DiskPinsAndQuotas(RuleBasedStateMachine):
    """Random puts, gets, pins and unpins across tenants on a real disk tier's folder."""

    eviction = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.folder = Path(tempfile.mkdtemp(prefix="kvplug-pins-"))
        self.tier, self.context = make_tier(
            self.folder,
            self.eviction,
            pin_max_bytes=4 * FILE,
            request_pin_max_bytes=2 * FILE,
            quotas={"tenant-a": 3 * FILE, "default": "30%"},
        )
        self.pinned: set[str] = set()
        self.evicted: list[str] = []  # records evicted while pinned
        self.context.emit = lambda event: (
            self.evicted.extend(set(event.keys) & self.pinned) if event.kind == "evicted" else None
        )
        self.open = True

    names = st.integers(min_value=0, max_value=30).map(str)
    tenants = st.sampled_from(TENANTS)

    @precondition(lambda self: self.open)
    @rule(tenant=tenants, name=names)
    def put(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        self.tier.put([(key, value_for(key, VALUE))])

    @precondition(lambda self: self.open)
    @rule(tenant=tenants, name=names)
    def get(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        value = self.tier.get([key])[0]
        assert value is None or bytes(value) == value_for(key, VALUE)

    @precondition(lambda self: self.open)
    @rule(tenant=tenants, name=names)
    def pin(self, tenant: str | None, name: str) -> None:  # an operator's: it may make request pins ordinary
        key = key_of(tenant, name)
        if self.tier.pin([key])[0][0] in ("pinned", "already"):
            self.pinned.add(key)
        policy = self.tier._disk._order._policy
        self.pinned = {key for key in self.pinned if policy.is_pinned(key_digest(key).hex())}

    @precondition(lambda self: self.open)
    @rule(tenant=tenants, name=names)
    def request_pin(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        self.context.tenancy.pins.add([key], requested=True)  # as pin_keys does for a request's pin
        if self.tier.pin([key])[0][0] in ("pinned", "already"):
            self.pinned.add(key)

    @precondition(lambda self: self.open)
    @rule(tenant=tenants, name=names)
    def unpin(self, tenant: str | None, name: str) -> None:
        key = key_of(tenant, name)
        self.tier.unpin([key])
        self.pinned.discard(key)

    @invariant()
    def budgets_hold_and_pins_stay(self) -> None:
        if not self.open:
            return
        extra = self.tier.stats().extra
        assert int(extra["folder_bytes"]) <= BUDGET
        assert int(extra["pinned_bytes"]) <= 4 * FILE
        assert not self.pinned & {k for k in self.evicted}, "a pinned record was evicted"
        assert all(self.tier.contains(sorted(self.pinned)))
        policy = self.tier._disk._order._policy  # the quotas count unpinned records and request pins
        for tenant, own in policy._own.items():
            requested = policy._pinned.requested_of(tenant)
            assert requested <= 2 * FILE, (tenant, requested)  # request_pin_max_bytes, per tenant
            quota = 3 * FILE if tenant == "tenant-a" else 3 * VALUE
            assert own.bytes_used + requested <= quota, (tenant, own.bytes_used, requested)

    def teardown(self) -> None:
        self.tier.close()
        shutil.rmtree(self.folder, ignore_errors=True)


class DiskPinsAndQuotasS3FIFO(DiskPinsAndQuotas):
    eviction = "s3fifo"


TestDiskPinsAndQuotasLRU = DiskPinsAndQuotas.TestCase
TestDiskPinsAndQuotasLRU.settings = settings(max_examples=15, stateful_step_count=40, deadline=None)
TestDiskPinsAndQuotasS3FIFO = DiskPinsAndQuotasS3FIFO.TestCase
TestDiskPinsAndQuotasS3FIFO.settings = settings(max_examples=15, stateful_step_count=40, deadline=None)
