"""The pinned keys of one tier's eviction order, and the budgets they are held to.

:class:`PinLedger` is the pin half of :class:`kvplug.GuardedEviction`: which keys are
pinned, their bytes within the tier's ``pin_budget``, and which of them a request pinned,
each tenant's request pins within its ``request_pin_budget`` and quota, and, for a store
several processes share (a disk folder), every process's pins within one budget
(:class:`SharedPins`). It decides and counts; the guard moves keys in and out of its
eviction policies. Not thread-safe, like the guard.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvplug.core.throttled_log import ThrottledLog


@dataclass(frozen=True)
class SharedPins:
    """A bound on the pins of every process sharing one store (the disk tier's folder): this
    process's pinned bytes plus ``others()`` (what the other processes say they pin, read
    afresh at each pin decision) stay within ``budget``, named ``name`` in a refusal."""

    budget: int
    others: Callable[[], int]
    name: str


class PinLedger:
    """Pinned keys and their bytes; request pins by tenant (see the module)."""

    def __init__(
        self,
        pin_budget: int | None,
        request_pin_budget: int | None,
        quota_of: Callable[[str | None], int | None],
        logger: logging.Logger,
        tier: str,
        shared: SharedPins | None = None,
    ) -> None:
        self.pin_budget = pin_budget
        self.shared = shared
        self.request_pin_budget = request_pin_budget
        self._quota_of = quota_of
        self._log = ThrottledLog(logger)
        self._tier = tier
        self.sizes: dict[str, int] = {}
        self.bytes = 0
        self._requested: OrderedDict[str, str | None] = OrderedDict()  # request-pinned key -> tenant, oldest first
        self._requested_bytes: dict[str | None, int] = {}
        #: Pins refused: a budget was spent.
        self.refused = 0
        #: Request pins an operator's pin turned back into ordinary keys.
        self.demoted = 0

    def __contains__(self, key: object) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def is_requested(self, key: str) -> bool:
        return key in self._requested

    def requested_of(self, tenant: str | None) -> int:
        """Bytes of ``tenant``'s request pins."""
        return self._requested_bytes.get(tenant, 0)

    def requested_total(self) -> int:
        """Bytes of every tenant's request pins."""
        return sum(self._requested_bytes.values())

    def request_limit(self, tenant: str | None) -> int | None:
        """The bytes a tenant's request pins may hold: its request pin budget, at most its quota."""
        limits = [limit for limit in (self.request_pin_budget, self._quota_of(tenant)) if limit is not None]
        return min(limits) if limits else None

    def fits(self, tenant: str | None, grow: int, requested: bool) -> bool:
        """Whether ``grow`` more pinned bytes (of a request's pin: ``requested``) fit the budgets."""
        if self.pin_budget is not None and self.bytes + grow > self.pin_budget:
            return False
        if grow > 0 and self.shared is not None and self._shared_spare(self.shared) < grow:
            return False
        limit = self.request_limit(tenant) if requested else None
        return limit is None or self.requested_of(tenant) + grow <= limit

    def room(self, key: str, tenant: str | None, size: int, requested: bool, demote: Callable[[str], object]) -> bool:
        """Whether ``key`` may be pinned now; ``False`` is counted and logged. An operator's
        pin makes room by handing request pins (oldest first) to ``demote``, which unpins
        them, if that is enough."""
        if requested:
            limit = self.request_limit(tenant)
            held = self.requested_of(tenant)
            if limit is not None and held + size > limit:
                return self._refuse(key, size, f"its tenant's request pins ({held} bytes) would pass {limit}")
        elif self.pin_budget is not None and self.bytes + size > self.pin_budget:
            if self.bytes - self.requested_total() + size <= self.pin_budget:
                while self.bytes + size > self.pin_budget and self._requested:
                    demote(next(iter(self._requested)))
                    self.demoted += 1
        if self.pin_budget is not None and self.bytes + size > self.pin_budget:
            return self._refuse(key, size, f"{self.bytes} pinned bytes would pass pin_max_bytes {self.pin_budget}")
        if self.shared is None:
            return True
        # Everyone's pins: an operator's pin does not displace request pins for them (other
        # processes' pins may leave no room however many this one gives up).
        spare = self._shared_spare(self.shared)
        if size <= spare:
            return True
        held = self.shared.budget - spare
        return self._refuse(key, size, f"{held} bytes pinned by every process would pass {self.shared.name}")

    def _shared_spare(self, shared: SharedPins) -> int:
        """Bytes more that the processes sharing the store may pin between them."""
        return shared.budget - self.bytes - shared.others()

    def set(self, key: str, tenant: str | None, size: int, requested: bool) -> None:
        """Pin ``key`` at ``size`` bytes, or change a pinned key's size (same ``requested``)."""
        old = self.sizes.get(key, 0)
        self.sizes[key] = size
        self.bytes += size - old
        if requested:
            tenant = self._requested.setdefault(key, tenant)  # a pinned key's tenant is the one it was pinned for
            self._requested_bytes[tenant] = self._requested_bytes.get(tenant, 0) + size - old

    def drop(self, key: str) -> int:
        """Unpin ``key`` (pinned): its size."""
        size = self.sizes.pop(key)
        self.bytes -= size
        if key in self._requested:
            tenant = self._requested.pop(key)
            left = self._requested_bytes.get(tenant, 0) - size
            if left:
                self._requested_bytes[tenant] = left
            else:
                self._requested_bytes.pop(tenant, None)
        return size

    def clear(self) -> None:
        self.sizes.clear()
        self.bytes = 0
        self._requested.clear()
        self._requested_bytes.clear()

    def _refuse(self, key: str, size: int, why: str) -> bool:
        self.refused += 1
        self._log.warning("tier %s: pin of %s (%d bytes) refused: %s", self._tier, key, size, why)
        return False
