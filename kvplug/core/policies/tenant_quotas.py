"""Each tenant's share of one tier's eviction order: its keys, quota, bytes and hits.

:class:`TenantQuotas` is the tenant half of :class:`kvplug.GuardedEviction` (as
:class:`~kvplug.core.pin_ledger.PinLedger` is its pin half): which tenant each salted key
belongs to, the bytes each tenant holds (pinned ones included) and the hits on its keys, by
salt (``None``: unsalted keys), and for a tenant with a quota an eviction policy of the
tier's kind over its own unpinned keys, with the tenants whose keys grew since the guard
last looked for victims over a quota. It keeps the books; the guard decides which keys are
listed, pinned and evicted. Not thread-safe, like the guard.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvplug.core.policies.eviction import EvictionPolicy, make_eviction_policy
from kvplug.core.tenants import TenantLabels


class TenantQuotas:
    """Quotas, bytes and hits per tenant; a policy per tenant with a quota (see the module)."""

    def __init__(
        self,
        eviction: str,
        quotas: Mapping[str, int] | None,
        default_quota: int | None,
        labels: TenantLabels,
        tenant_of: Callable[[str], str | None],
    ) -> None:
        self.eviction = eviction
        self.quotas = dict(quotas or {})
        self.default_quota = default_quota
        self._labels = labels
        self._tenant_of = tenant_of
        self.by_key: dict[str, str] = {}  # salted keys only (pinned or not)
        self.own: dict[str, EvictionPolicy] = {}  # tenants with a quota: their unpinned keys
        self._held: dict[str | None, int] = {}  # bytes per tenant, pinned included
        self._hits: dict[str | None, int] = {}
        self._due: set[str] = set()  # tenants that grew since take_due

    def tenant_of(self, key: str) -> str | None:
        """The tenant of ``key``: as the owner resolves it, else as learnt when it entered."""
        return self._tenant_of(key) or self.by_key.get(key)

    def adopt(self, tenants: Mapping[str, str]) -> None:
        """Remember tenants learnt before a rebuild, for keys inserted from now on."""
        known = dict(tenants)
        resolve = self._tenant_of
        self._tenant_of = lambda key: resolve(key) or known.get(key)

    def attribute(self, key: str, size: int) -> str | None:
        """A held key (``size`` bytes, not pinned) whose tenant was unknown when it entered (a
        record found in a shared folder): its tenant, if known by now, takes it over (its
        quota, its figures)."""
        tenant = self._tenant_of(key)
        if tenant is None:
            return None
        self.by_key[key] = tenant
        self.add_held(None, -size)
        self.add_held(tenant, size)
        self.listed(tenant, key, size)
        return tenant

    def quota_of(self, tenant: str | None) -> int | None:
        """The quota of ``tenant`` (``None``: none, as for unsalted keys)."""
        if tenant is None:
            return None
        return self.quotas.get(tenant, self.default_quota)

    def own_policy(self, tenant: str | None) -> EvictionPolicy | None:
        """The policy over ``tenant``'s own unpinned keys (made on first use), ``None`` without a quota."""
        if tenant is None or self.quota_of(tenant) is None:
            return None
        own = self.own.get(tenant)
        if own is None:
            own = self.own[tenant] = make_eviction_policy(self.eviction)
        return own

    def listed(self, tenant: str | None, key: str, size: int, *, cold: bool = False) -> None:
        """``key`` of ``tenant`` became evictable: into its tenant's own policy, if it has a quota."""
        own = self.own_policy(tenant)
        if own is not None:
            own.inserted(key, size, cold=cold)
            self._due.add(tenant)  # type: ignore[arg-type]  # (own is only found for a tenant)

    def unlisted(self, tenant: str | None, key: str) -> None:
        """``key`` of ``tenant`` is no longer evictable: out of its tenant's own policy."""
        own = self.own.get(tenant) if tenant is not None else None
        if own is not None:
            own.removed(key)

    def accessed(self, tenant: str | None, key: str) -> None:
        own = self.own.get(tenant) if tenant is not None else None
        if own is not None:
            own.accessed(key)

    def hit(self, tenant: str | None) -> None:
        self._hits[tenant] = self._hits.get(tenant, 0) + 1

    def pinned_for_request(self, tenant: str | None) -> None:
        """A request pinned a key of ``tenant``: it counts against a quota it has."""
        if self.own_policy(tenant) is not None:
            self._due.add(tenant)  # type: ignore[arg-type]  # (own is only found for a tenant)

    def take_due(self) -> set[str]:
        """The tenants whose keys grew since the last call."""
        due, self._due = self._due, set()
        return due

    def unpinned_of(self, tenant: str) -> int:
        """Bytes of ``tenant``'s evictable keys (0 without a quota)."""
        own = self.own.get(tenant)
        return 0 if own is None else own.bytes_used

    def add_held(self, tenant: str | None, delta: int) -> None:
        held = self._held.get(tenant, 0) + delta
        if held:
            self._held[tenant] = held
        else:
            self._held.pop(tenant, None)

    def held_of(self, tenant: str) -> int:
        """Bytes of ``tenant``'s keys, pinned ones included."""
        return self._held.get(tenant, 0)

    def figures(self) -> dict[str, tuple[int, int]]:
        """(bytes held, hits) by metrics label: named tenants, ``(other)``, ``(unsalted)``."""
        figures: dict[str, tuple[int, int]] = {}
        for tenant in self._held.keys() | self._hits.keys():
            label = self._labels.label(tenant, self.quotas)
            held, hits = figures.get(label, (0, 0))
            figures[label] = (held + self._held.get(tenant, 0), hits + self._hits.get(tenant, 0))
        return figures

    def clear(self) -> None:
        """Forget every tenant's keys and bytes (the hits stay: they are counters)."""
        self.by_key.clear()
        self.own.clear()
        self._held.clear()
        self._due.clear()
