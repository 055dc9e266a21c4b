"""An eviction policy that keeps pinned keys and holds each tenant to its quota.

:class:`GuardedEviction` wraps the tier's policy (``lru`` or ``s3fifo``, any
:class:`~kvplug.EvictionPolicy`): a pinned key leaves both the policy and the
accounting it evicts by, so no policy can ever choose it, and comes back as a fresh
insert when unpinned. Each tenant with a quota also has a policy of the same kind
over its own keys only: a tenant over its quota gives up victims from there
(:meth:`GuardedEviction.take_over_quota`), its own keys in its own order, never
another's. The tier's budget still evicts in the tier-wide order.

Like the policies, not thread-safe: the owner calls it under its own lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Literal

from kvplug.core.eviction import EvictionPolicy, make_eviction_policy
from kvplug.core.tenancy import tenant_label
from kvplug.core.tenant_metrics import TENANT_BYTES, TENANT_HITS

#: What :meth:`GuardedEviction.pin` did.
PinOutcome = Literal["pinned", "already", "refused", "missing"]

_NOBODY: Callable[[str], str | None] = lambda name: None  # noqa: E731
_NOTHING: Callable[[str], bool] = lambda name: False  # noqa: E731


class GuardedEviction(EvictionPolicy):
    """``eviction``'s order, less the pinned keys, with per-tenant quotas (see the module)."""

    name = "guarded"

    def __init__(
        self,
        eviction: str,
        *,
        pin_budget: int | None = None,
        quotas: Mapping[str, int] | None = None,
        default_quota: int | None = None,
        tenant_of: Callable[[str], str | None] = _NOBODY,
        wants_pin: Callable[[str], bool] = _NOTHING,
        logger: logging.Logger | None = None,
        tier: str = "",
    ) -> None:
        self.eviction = eviction
        self._policy = make_eviction_policy(eviction)
        self.pin_budget = pin_budget
        self.quotas = dict(quotas or {})
        self.default_quota = default_quota
        self._tenant_of = tenant_of
        self._wants_pin = wants_pin
        self._logger = logger or logging.getLogger("kvplug.tier")
        self._tier = tier
        self._sizes: dict[str, int] = {}  # unpinned keys
        self._pinned: dict[str, int] = {}
        self.pinned_bytes = 0
        self._tenant: dict[str, str] = {}  # salted keys only (pinned or not)
        self._own: dict[str, EvictionPolicy] = {}  # tenants with a quota: their unpinned keys
        self._held: dict[str | None, int] = {}  # bytes per tenant, pinned included
        self._hits: dict[str | None, int] = {}
        self._due: set[str] = set()  # tenants that grew since take_over_quota
        #: Pins refused because ``pin_budget`` was spent.
        self.pins_refused = 0
        #: Keys evicted because their tenant was over its quota.
        self.quota_evictions = 0

    # --- the EvictionPolicy interface -----------------------------------------------

    def inserted(self, key: str, size: int, *, cold: bool = False) -> None:
        tenant = self._tenant_of(key) or self._tenant.get(key)
        may_pin = True
        if key in self._pinned:
            old_pinned = self._pinned[key]
            self._add_held(tenant, size - old_pinned)
            if self.pin_budget is None or self.pinned_bytes - old_pinned + size <= self.pin_budget:
                self.pinned_bytes += size - old_pinned
                self._pinned[key] = size
                return
            # A pinned key stored again, larger, past the pin budget: an ordinary key from now on.
            del self._pinned[key]
            self.pinned_bytes -= old_pinned
            self._add_held(tenant, -size)
            may_pin = self._room_for_pin(key, size)  # False: counted and logged as a refusal
        old = self._sizes.get(key)
        if old is not None:
            self._add_held(self._tenant.get(key), -old)
        if tenant is not None:
            self._tenant[key] = tenant
        self._add_held(tenant, size)
        if may_pin and self._wants_pin(key) and self._room_for_pin(key, size):
            if old is not None:
                self._unlist(key)
            self._pinned[key] = size
            self.pinned_bytes += size
            return
        self._sizes[key] = size
        self._policy.inserted(key, size, cold=cold)
        own = self._own_policy(tenant)
        if own is not None:
            own.inserted(key, size, cold=cold)
            self._due.add(tenant)  # type: ignore[arg-type]  # (own is only found for a tenant)

    def accessed(self, key: str) -> None:
        self._policy.accessed(key)
        tenant = self._tenant.get(key)
        if tenant is None and key in self._sizes:
            tenant = self._attribute(key)
        own = self._own.get(tenant) if tenant is not None else None
        if own is not None:
            own.accessed(key)
        if key in self._sizes or key in self._pinned:
            self._hits[tenant] = self._hits.get(tenant, 0) + 1

    def removed(self, key: str) -> None:
        size = self._pinned.pop(key, None)
        if size is not None:
            self.pinned_bytes -= size
        else:
            size = self._sizes.get(key)
            if size is None:
                return
            self._unlist(key)
        self._add_held(self._tenant.pop(key, None), -size)

    def pop_victim(self) -> tuple[str, int] | None:
        victim = self._policy.pop_victim()
        if victim is not None:
            self._forget(victim[0], in_policy=False)
        return victim

    def clear(self) -> None:
        self._policy.clear()
        self._sizes.clear()
        self._pinned.clear()
        self.pinned_bytes = 0
        self._tenant.clear()
        self._own.clear()
        self._held.clear()
        self._due.clear()

    def __len__(self) -> int:
        return len(self._sizes) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes or key in self._pinned

    @property
    def bytes_used(self) -> int:
        return self._policy.bytes_used + self.pinned_bytes

    def state(self) -> dict[str, int]:
        return {
            **self._policy.state(),
            "pinned_items": len(self._pinned),
            "pinned_bytes": self.pinned_bytes,
            "pins_refused": self.pins_refused,
            "quota_evictions": self.quota_evictions,
        }

    # --- pins and quotas ------------------------------------------------------------

    def pin(self, key: str) -> PinOutcome:
        """Take a held key out of eviction, within ``pin_budget``."""
        if key in self._pinned:
            return "already"
        size = self._sizes.get(key)
        if size is None:
            return "missing"
        if not self._room_for_pin(key, size):
            return "refused"
        self._unlist(key)
        self._pinned[key] = size
        self.pinned_bytes += size
        return "pinned"

    def unpin(self, key: str) -> int | None:
        """Make a pinned key evictable again (a fresh insert); its size, or ``None`` if not pinned."""
        size = self._pinned.pop(key, None)
        if size is None:
            return None
        self.pinned_bytes -= size
        tenant = self._tenant.get(key)
        self._sizes[key] = size
        self._policy.inserted(key, size)
        own = self._own_policy(tenant)
        if own is not None:
            own.inserted(key, size)
            self._due.add(tenant)  # type: ignore[arg-type]
        return size

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def take_over_quota(self) -> list[tuple[str, int]]:
        """Victims of the tenants now over their quotas, each from its own keys; the owner drops them."""
        victims: list[tuple[str, int]] = []
        due, self._due = self._due, set()
        for tenant in due:
            own = self._own.get(tenant)
            quota = self._quota_of(tenant)
            if own is None or quota is None:
                continue
            while own.bytes_used > quota:
                victim = own.pop_victim()
                if victim is None:
                    break
                self._policy.removed(victim[0])
                self._forget(victim[0], in_policy=False, in_own=False)
                self.quota_evictions += 1
                victims.append(victim)
        return victims

    def tenant_figures(self) -> dict[str, tuple[int, int]]:
        """(bytes held, hits) by metrics label: named tenants, ``(other)``, ``(unsalted)``."""
        figures: dict[str, tuple[int, int]] = {}
        for tenant in self._held.keys() | self._hits.keys():
            label = tenant_label(tenant, self.quotas)
            held, hits = figures.get(label, (0, 0))
            figures[label] = (held + self._held.get(tenant, 0), hits + self._hits.get(tenant, 0))
        return figures

    def stats_extra(self) -> dict[str, int]:
        """Figures for a tier's ``stats().extra``: pins, refusals, quota evictions, and per
        tenant label ``tenant_bytes:<label>`` and ``tenant_hits:<label>`` (metrics read these)."""
        extra = {
            "pinned_items": len(self._pinned),
            "pinned_bytes": self.pinned_bytes,
            "pins_refused": self.pins_refused,
            "quota_evictions": self.quota_evictions,
        }
        for label, (held, hits) in sorted(self.tenant_figures().items()):
            extra[f"{TENANT_BYTES}{label}"] = held
            extra[f"{TENANT_HITS}{label}"] = hits
        return extra

    def tenants_of(self) -> dict[str, str]:
        """The salted keys' tenants (for an owner that rebuilds its policy: :meth:`adopt_tenants`)."""
        return dict(self._tenant)

    def adopt_tenants(self, tenants: Mapping[str, str]) -> None:
        """Remember tenants learnt before a rebuild, for keys inserted from now on."""
        known = dict(tenants)
        resolve = self._tenant_of
        self._tenant_of = lambda key: resolve(key) or known.get(key)

    # --- helpers --------------------------------------------------------------------

    def _attribute(self, key: str) -> str | None:
        """A held key whose tenant was unknown when it entered (a record found in a shared
        folder): its tenant, if known by now, takes it over (its quota, its figures)."""
        tenant = self._tenant_of(key)
        if tenant is None:
            return None
        size = self._sizes[key]
        self._tenant[key] = tenant
        self._add_held(None, -size)
        self._add_held(tenant, size)
        own = self._own_policy(tenant)
        if own is not None:
            own.inserted(key, size)
            self._due.add(tenant)
        return tenant

    def _room_for_pin(self, key: str, size: int) -> bool:
        if self.pin_budget is None or self.pinned_bytes + size <= self.pin_budget:
            return True
        self.pins_refused += 1
        if self.pins_refused == 1 or self.pins_refused % 1000 == 0:
            self._logger.warning(
                "tier %s: pin of %s refused: %d pinned bytes + %d would pass pin_max_bytes %d (%d refused so far)",
                self._tier,
                key,
                self.pinned_bytes,
                size,
                self.pin_budget,
                self.pins_refused,
            )
        return False

    def _quota_of(self, tenant: str | None) -> int | None:
        if tenant is None:
            return None
        return self.quotas.get(tenant, self.default_quota)

    def _own_policy(self, tenant: str | None) -> EvictionPolicy | None:
        if tenant is None or self._quota_of(tenant) is None:
            return None
        own = self._own.get(tenant)
        if own is None:
            own = self._own[tenant] = make_eviction_policy(self.eviction)
        return own

    def _unlist(self, key: str) -> None:
        """Take an unpinned key out of the policies (not out of the tenant's bytes)."""
        del self._sizes[key]
        self._policy.removed(key)
        tenant = self._tenant.get(key)
        own = self._own.get(tenant) if tenant is not None else None
        if own is not None:
            own.removed(key)

    def _forget(self, key: str, *, in_policy: bool, in_own: bool = True) -> None:
        """A victim left: drop it from the accounting (and the policies named)."""
        size = self._sizes.pop(key)
        if in_policy:
            self._policy.removed(key)
        tenant = self._tenant.pop(key, None)
        if in_own and tenant is not None:
            own = self._own.get(tenant)
            if own is not None:
                own.removed(key)
        self._add_held(tenant, -size)

    def _add_held(self, tenant: str | None, delta: int) -> None:
        held = self._held.get(tenant, 0) + delta
        if held:
            self._held[tenant] = held
        else:
            self._held.pop(tenant, None)
