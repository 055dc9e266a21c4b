"""Tiers ``disk`` and ``shm``: pins and per-tenant quotas, on real folders: kvplug's contract suite,
and the disk tier's own cases."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvplug import StorageTier, TierChain, TierContext, key_digest
from kvplug.core.pins import pin_keys
from kvplug.testing import PinsAndQuotasContract, pins_context, value_for
from kvplug.testing.pins_contract import TENANTS, key_of
from kvplug_disk import DiskTier
from kvplug_disk.shm import ShmTier

VALUE = 1000
FILE = VALUE + 64  # a record file: the value and its header; pins and quotas count file bytes
BUDGET = 10 * VALUE


def make_tier(
    path: Path,
    eviction: str = "lru",
    context: TierContext | None = None,
    tier: type[DiskTier] = DiskTier,
    **options: object,
) -> tuple[DiskTier, TierContext]:
    context = pins_context(context)
    config = tier.Config(path=path, eviction=eviction, fsync=False, max_bytes=BUDGET, **options)  # type: ignore[arg-type]
    return tier(config, context), context


class TestDiskPinsAndQuotas(PinsAndQuotasContract):
    value, unit = VALUE, FILE

    @pytest.fixture
    def make_tier(self, tmp_path: Path) -> Callable[..., tuple[DiskTier, TierContext]]:
        return lambda eviction="lru", **options: make_tier(tmp_path / "disk", eviction, **options)


def fill_with_one_offs(tier: StorageTier) -> None:
    """Store 40 unpinned one-off records: the tier evicts all it may several times over."""
    for i in range(40):
        key = key_of(None, f"one-off-{i}")
        tier.put([(key, value_for(key, VALUE))])


def test_shm_keeps_pins_too(tmp_path: Path) -> None:
    tier, context = make_tier(tmp_path / "shm", "s3fifo", tier=ShmTier, pin_max_bytes="40%")
    system = key_of("tenant-a", "system")
    tier.put([(system, value_for(system, VALUE))])
    chain = TierChain([tier])
    chain.tenancy = context.tenancy
    assert pin_keys(chain, [system]).chunks == 1
    fill_with_one_offs(tier)
    assert tier.contains([system]) == [True]
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
    fill_with_one_offs(tier)
    assert tier.contains([system]) == [True]
    tier.close()


@pytest.mark.parametrize("eviction", ["lru", "s3fifo"])
def test_a_pinned_record_stored_again_stays_pinned(tmp_path: Path, eviction: str) -> None:
    tier, _ = make_tier(tmp_path / "disk", eviction, queue={"mode": "sync"})  # pins not in any pin book
    system = key_of(None, "system")
    tier.put([(system, value_for(system, VALUE))])
    assert tier.pin([system]) == [("pinned", VALUE)]
    tier.put([(system, value_for(system, VALUE))])  # stored again (a promotion, another engine's store)
    assert tier.stats().extra["pinned_items"] == 1
    fill_with_one_offs(tier)
    assert tier.contains([system]) == [True]
    tier.close()


def test_pins_outlive_a_relisting_of_the_folder(tmp_path: Path) -> None:
    """A tier that has nothing of its own left to evict lists the folder again (another
    process's records fill it): the records it pinned stay pinned."""
    tier, _ = make_tier(tmp_path / "disk", queue={"mode": "sync"})  # pins not in any pin book
    other, _ = make_tier(tmp_path / "disk", queue={"mode": "sync"})  # another process's tier of the folder
    system = key_of(None, "system")
    tier.put([(system, value_for(system, VALUE))])
    assert tier.pin([system]) == [("pinned", VALUE)]
    for i in range(9):  # the folder is full: every record but the pinned one is the other tier's
        key = key_of(None, f"other-{i}")
        other.put([(key, value_for(key, VALUE))])
    for i in range(5):  # this tier knows of nothing else to evict: it lists the folder
        key = key_of(None, f"own-{i}")
        tier.put([(key, value_for(key, VALUE))])
        assert tier.contains([system]) == [True], f"the pinned record was evicted by put {i}"
    assert tier.stats().extra["pinned_items"] == 1
    other.close()
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
        for tenant, own in policy._tenants.own.items():
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
