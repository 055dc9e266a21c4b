"""An eviction policy that keeps pinned keys and holds each tenant to its quota.

:class:`GuardedEviction` wraps the tier's policy (``lru`` or ``s3fifo``, any
:class:`~kvplug.core.policies.eviction.EvictionPolicy`): a pinned key leaves both the policy and the
accounting it evicts by, so no policy can ever choose it, and comes back as a fresh
insert when unpinned. Each tenant with a quota also has a policy of the same kind
over its own keys only: a tenant over its quota gives up victims from there
(:meth:`GuardedEviction.take_over_quota`), its own keys in its own order, never
another's. The tier's budget still evicts in the tier-wide order.

A request's pin (the pin book says only requests want the key) also counts against its
tenant: within ``request_pin_budget`` and the tenant's quota, and in the quota's
accounting, so a tenant cannot hold more than its quota by pinning. An operator's pin
that does not fit in ``pin_budget`` turns request pins (oldest first) back into ordinary
chunks. A store that could not be kept (no room beside the pinned chunks, a chunk larger
than its tenant's quota) is refused before it evicts anything (:meth:`admits`), counted
by reason and logged.

Like the policies, not thread-safe: the owner calls it under its own lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Literal

from kvplug.core.pin_ledger import PinLedger, SharedPins
from kvplug.core.policies.eviction import EvictionPolicy, make_eviction_policy
from kvplug.core.policies.tenant_quotas import TenantQuotas
from kvplug.core.tenants import STORES_REFUSED, TENANT_BYTES, TENANT_HITS, TenantLabels
from kvplug.core.throttled_log import ThrottledLog

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
        request_pin_budget: int | None = None,
        requested_pin: Callable[[str], bool] = _NOTHING,
        labels: TenantLabels | None = None,
        shared_pins: SharedPins | None = None,
    ) -> None:
        self.eviction = eviction
        self._policy = make_eviction_policy(eviction)
        self._tenants = TenantQuotas(eviction, quotas, default_quota, labels or TenantLabels(), tenant_of)
        self._wants_pin = wants_pin
        self._requested_pin = requested_pin
        logger = logger or logging.getLogger("kvplug.tier")
        self._pinned = PinLedger(pin_budget, request_pin_budget, self.quota_of, logger, tier, shared_pins)
        self._store_log = ThrottledLog(logger)
        self._tier = tier
        self._sizes: dict[str, int] = {}  # unpinned keys
        #: Keys evicted because their tenant was over its quota.
        self.quota_evictions = 0
        #: Stores refused before they evicted anything, by reason (``pins``, ``quota``).
        self.stores_refused: dict[str, int] = {"pins": 0, "quota": 0}

    @property
    def quotas(self) -> dict[str, int]:
        return self._tenants.quotas

    @property
    def default_quota(self) -> int | None:
        return self._tenants.default_quota

    @property
    def pin_budget(self) -> int | None:
        return self._pinned.pin_budget

    @property
    def pinned_bytes(self) -> int:
        return self._pinned.bytes

    @property
    def pins_refused(self) -> int:
        """Pins refused because ``pin_budget`` (or a tenant's request pin budget) was spent."""
        return self._pinned.refused

    # --- the EvictionPolicy interface -----------------------------------------------

    def inserted(self, key: str, size: int, *, cold: bool = False) -> None:
        tenant = self._tenants.tenant_of(key)
        pin_as: bool | None = None  # pin it: whether as a request's pin
        pins = self._pinned
        if key in pins:
            old_pinned, requested = pins.sizes[key], pins.is_requested(key)
            self._tenants.add_held(tenant, size - old_pinned)
            if pins.fits(tenant, size - old_pinned, requested):
                self._pin(key, tenant, size, requested)  # (a request's pin that grew: its tenant's quota applies)
                return
            # A pinned key stored again, larger, past a pin budget: an ordinary key from now on.
            pins.drop(key)
            self._tenants.add_held(tenant, -size)
            if pins.room(key, tenant, size, requested, self.unpin):  # False: counted and logged as a refusal
                pin_as = requested
        elif self._wants_pin(key):
            requested = self._requested_pin(key)
            if pins.room(key, tenant, size, requested, self.unpin):
                pin_as = requested
        old = self._sizes.get(key)
        if old is not None:
            self._tenants.add_held(self._tenants.by_key.get(key), -old)
        if tenant is not None:
            self._tenants.by_key[key] = tenant
        self._tenants.add_held(tenant, size)
        if pin_as is not None:
            if old is not None:
                self._unlist(key)
            self._pin(key, tenant, size, pin_as)
            return
        self._sizes[key] = size
        self._policy.inserted(key, size, cold=cold)
        self._tenants.listed(tenant, key, size, cold=cold)

    def accessed(self, key: str) -> None:
        self._policy.accessed(key)
        tenant = self._tenants.by_key.get(key)
        if tenant is None and key in self._sizes:
            tenant = self._tenants.attribute(key, self._sizes[key])
        self._tenants.accessed(tenant, key)
        if key in self._sizes or key in self._pinned:
            self._tenants.hit(tenant)

    def removed(self, key: str) -> None:
        if key in self._pinned:
            size = self._pinned.drop(key)
        elif key in self._sizes:
            size = self._sizes[key]
            self._unlist(key)
        else:
            return
        self._tenants.add_held(self._tenants.by_key.pop(key, None), -size)

    def pop_victim(self) -> tuple[str, int] | None:
        victim = self._policy.pop_victim()
        if victim is not None:
            self._forget(victim[0], in_policy=False)
        return victim

    def clear(self) -> None:
        self._policy.clear()
        self._sizes.clear()
        self._pinned.clear()
        self._tenants.clear()

    def __len__(self) -> int:
        return len(self._sizes) + len(self._pinned)

    def __contains__(self, key: object) -> bool:
        return key in self._sizes or key in self._pinned

    @property
    def bytes_used(self) -> int:
        return self._policy.bytes_used + self._pinned.bytes

    def state(self) -> dict[str, int]:
        return {**self._policy.state(), **self._pin_figures()}

    def _pin_figures(self) -> dict[str, int]:
        return {
            "pinned_items": len(self._pinned),
            "pinned_bytes": self._pinned.bytes,
            "pins_refused": self.pins_refused,
            "quota_evictions": self.quota_evictions,
            "request_pinned_bytes": self._pinned.requested_total(),
        }

    # --- pins and quotas ------------------------------------------------------------

    def pin(self, key: str) -> PinOutcome:
        """Take a held key out of eviction, within ``pin_budget`` (and, for a request's pin,
        within its tenant's ``request_pin_budget`` and quota)."""
        requested, pins = self._requested_pin(key), self._pinned
        if key in pins:
            if pins.is_requested(key) and not requested:  # an operator's pin of a request's: theirs now
                pins.set(key, None, pins.drop(key), False)
            return "already"
        size = self._sizes.get(key)
        if size is None:
            return "missing"
        tenant = self._tenants.by_key.get(key)
        if not pins.room(key, tenant, size, requested, self.unpin):
            return "refused"
        self._unlist(key)
        self._pin(key, tenant, size, requested)
        return "pinned"

    def unpin(self, key: str) -> int | None:
        """Make a pinned key evictable again (a fresh insert); its size, or ``None`` if not pinned."""
        if key not in self._pinned:
            return None
        size = self._pinned.drop(key)
        tenant = self._tenants.by_key.get(key)
        self._sizes[key] = size
        self._policy.inserted(key, size)
        self._tenants.listed(tenant, key, size)
        return size

    def admits(self, key: str, size: int, budget: int | None, *, overhead: int = 0) -> bool:
        """Whether a store of ``key`` (``size`` bytes) into a tier of ``budget`` bytes can be
        kept: ``False`` (counted by reason, logged) when it would be evicted at once, by
        the tier's budget because pinned chunks leave less room than it (``pins``), or by
        its tenant's quota, less the tenant's request pins (``quota``). Call before
        :meth:`inserted`: a refused store then evicts nothing. ``overhead``: bytes each key
        counts here but not against ``budget`` (the disk tier: a record file's header)."""
        pins = self._pinned
        if key in pins:
            return True
        tenant: str | None = None
        if self._wants_pin(key):
            tenant = self._tenants.tenant_of(key)
            if pins.fits(tenant, size, self._requested_pin(key)):
                return True
        pinned = pins.bytes - overhead * len(pins)
        if budget is not None and pinned + size - overhead > budget:
            room = budget - pinned
            return self._refuse_store(key, "pins", f"{size - overhead} bytes, {room} left beside the pinned chunks")
        if not self.quotas and self.default_quota is None:  # (the common case: no lookup of the tenant)
            return True
        tenant = tenant or self._tenants.tenant_of(key)
        quota = self.quota_of(tenant)
        pinned = self._pinned.requested_of(tenant)
        if quota is not None and pinned + size > quota:
            return self._refuse_store(key, "quota", f"{size} bytes, its tenant's quota {quota} ({pinned} pinned)")
        return True

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def take_over_quota(self) -> list[tuple[str, int]]:
        """Victims of the tenants now over their quotas, each from its own keys; the owner drops them."""
        victims: list[tuple[str, int]] = []
        for tenant in self._tenants.take_due():
            own = self._tenants.own.get(tenant)
            quota = self.quota_of(tenant)
            if own is None or quota is None:
                continue
            while own.bytes_used + self._pinned.requested_of(tenant) > quota:
                victim = self.take_victim_of(tenant)
                if victim is None:
                    break
                victims.append(victim)
        return victims

    def take_victim_of(self, tenant: str) -> tuple[str, int] | None:
        """The next unpinned key of ``tenant`` in its own order, evicted for its quota (the
        owner drops it): for an owner that counts the tenant beyond this policy (a shared folder)."""
        own = self._tenants.own.get(tenant)
        victim = None if own is None else own.pop_victim()
        if victim is not None:
            self._policy.removed(victim[0])
            self._forget(victim[0], in_policy=False, in_own=False)
            self.quota_evictions += 1
        return victim

    def held_of(self, tenant: str) -> int:
        """Bytes of ``tenant``'s keys, pinned ones included."""
        return self._tenants.held_of(tenant)

    def operator_pinned_of(self, tenant: str) -> int:
        """Bytes of ``tenant``'s keys pinned by the operator (which no quota counts)."""
        own = self._tenants.own.get(tenant)
        unpinned = 0 if own is None else own.bytes_used
        return self.held_of(tenant) - unpinned - self._pinned.requested_of(tenant)

    def tenant_figures(self) -> dict[str, tuple[int, int]]:
        """(bytes held, hits) by metrics label: named tenants, ``(other)``, ``(unsalted)``."""
        return self._tenants.figures()

    def stats_extra(self) -> dict[str, int]:
        """Figures for a tier's ``stats().extra``: pins, refusals, quota evictions, stores refused
        by reason (``stores_refused:<reason>``), and per tenant label ``tenant_bytes:<label>``
        and ``tenant_hits:<label>`` (metrics read these)."""
        extra = {**self._pin_figures(), "request_pins_demoted": self._pinned.demoted}
        for reason, count in sorted(self.stores_refused.items()):
            extra[f"{STORES_REFUSED}{reason}"] = count
        for label, (held, hits) in sorted(self.tenant_figures().items()):
            extra[f"{TENANT_BYTES}{label}"] = held
            extra[f"{TENANT_HITS}{label}"] = hits
        return extra

    def tenants_of(self) -> dict[str, str]:
        """The salted keys' tenants (for an owner that rebuilds its policy: :meth:`adopt_tenants`)."""
        return dict(self._tenants.by_key)

    def adopt_tenants(self, tenants: Mapping[str, str]) -> None:
        """Remember tenants learnt before a rebuild, for keys inserted from now on."""
        self._tenants.adopt(tenants)

    # --- helpers --------------------------------------------------------------------

    def _refuse_store(self, key: str, reason: str, why: str) -> bool:
        self.stores_refused[reason] = self.stores_refused.get(reason, 0) + 1
        self._store_log.warning("tier %s: store of %s refused (%s): %s", self._tier, key, reason, why)
        return False

    def _pin(self, key: str, tenant: str | None, size: int, requested: bool) -> None:
        """Pin ``key`` (out of the policies already); a request's pin counts against its tenant's quota."""
        self._pinned.set(key, tenant, size, requested)
        if requested:
            self._tenants.pinned_for_request(tenant)

    def quota_of(self, tenant: str | None) -> int | None:
        """The quota of ``tenant`` (``None``: none, as for unsalted keys)."""
        return self._tenants.quota_of(tenant)

    def _unlist(self, key: str) -> None:
        """Take an unpinned key out of the policies (not out of the tenant's bytes)."""
        del self._sizes[key]
        self._policy.removed(key)
        self._tenants.unlisted(self._tenants.by_key.get(key), key)

    def _forget(self, key: str, *, in_policy: bool, in_own: bool = True) -> None:
        """A victim left: drop it from the accounting (and the policies named)."""
        size = self._sizes.pop(key)
        if in_policy:
            self._policy.removed(key)
        tenant = self._tenants.by_key.pop(key, None)
        if in_own:
            self._tenants.unlisted(tenant, key)
        self._tenants.add_held(tenant, -size)
