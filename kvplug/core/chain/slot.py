"""One tier of a :class:`~kvplug.core.chain.tier_chain.TierChain`: the tier, its settings, its
write queue and admission policy, and its calls guarded so a tier that raises is a miss."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import ParamSpec, TypeVar

from kvplug.core.chain.write_queue import Items, WriteQueue
from kvplug.core.events import KVEvent
from kvplug.core.listeners import Listeners
from kvplug.core.metrics import EngineMetrics
from kvplug.core.policies.admission import AdmissionPolicy
from kvplug.core.tier import Buffer, StorageTier, TierConfig, TierStats

logger = logging.getLogger("kvplug.tiers")

_P = ParamSpec("_P")
_R = TypeVar("_R")


class WriteListeners(Listeners[[int, Sequence[str]]]):
    """Who hears which keys a chain's own writes put in which tier (:attr:`TierChain.writes`).

    A listener is called on the thread that wrote (a store or queue thread) after each
    write a tier took without raising: it must be quick. What a tier already held is not
    written again (the chain asks first), so a listener learns which records this chain
    put there, as against another process's. One that raises is logged; the others run.
    """

    def __init__(self) -> None:
        super().__init__(logger, "write listener")

    def notify(self, index: int, keys: Sequence[str]) -> None:
        self.call_each(index, keys)


@dataclass
class TierSlot:
    """A tier, its settings and its write queue (async tiers); its calls guarded.

    Each guarded call is the tier's own method: a tier that raises answers ``None``
    (a miss), counted in ``tier_errors`` under the operation's name and logged.
    ``contains`` and ``get`` answer for keys in the write queue from the queue.
    """

    tier: StorageTier
    settings: TierConfig
    label: str
    queue: WriteQueue | None
    metrics: EngineMetrics
    admission: AdmissionPolicy
    #: The tier's index in its chain, as write listeners are told it.
    index: int = 0
    writes: WriteListeners = field(default_factory=WriteListeners)

    def contains(self, keys: list[str]) -> list[bool] | None:
        queued = self.queue.values(keys) if self.queue is not None else [None] * len(keys)
        ask = [key for key, value in zip(keys, queued) if value is None]
        if len(ask) == len(keys):
            return self.stored(keys)
        answers = iter((self.stored(ask) if ask else None) or [False] * len(ask))
        return [value is not None or bool(next(answers)) for value in queued]

    def stored(self, keys: list[str]) -> list[bool] | None:
        """``contains`` of the tier itself, not counting its queue."""
        return self._guard("contains", self.tier.contains, keys)

    def get(self, keys: list[str]) -> list[Buffer | None] | None:
        queued = self.queue.values(keys) if self.queue is not None else [None] * len(keys)
        ask = [key for key, value in zip(keys, queued) if value is None]
        if len(ask) == len(keys):
            return self._guard("get", self.tier.get, keys)
        answers = iter((self._guard("get", self.tier.get, ask) if ask else None) or [None] * len(ask))
        return [value if value is not None else next(answers) for value in queued]

    def put(self, items: Items) -> None:
        if self._guard("put", self._put, items):
            keys = [key for key, _ in items]
            self.writes.notify(self.index, keys)
            if not self.tier.reports_stored:  # a tier that reports its puts knows what it refused
                self.tier.context.emit(KVEvent("stored", tuple(keys), tier=self.tier.name))

    def _put(self, items: Items) -> bool:
        self.tier.put(items)
        return True

    def remove(self, keys: list[str]) -> bool:
        """Remove ``keys`` from the tier; ``False`` if it raised (logged and counted)."""
        return bool(self._guard("remove", self._remove, keys))

    def _remove(self, keys: list[str]) -> bool:
        self.tier.remove(keys)
        return True

    def remove_if_same(self, items: Items) -> bool:
        """Remove each key while the tier holds the value given with it; ``False`` if it raised."""
        return bool(self._guard("remove", self._remove_if_same, items))

    def _remove_if_same(self, items: Items) -> bool:
        self.tier.remove_if_same(items)
        return True

    def stats(self) -> TierStats | None:
        return self._guard("stats", self.tier.stats)

    def flush(self) -> None:
        self._guard("flush", self.tier.flush)

    def settle(self) -> None:
        self._guard("settle", self.tier.settle)

    def close(self) -> None:
        self._guard("close", self.tier.close)

    def _guard(self, op: str, method: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        try:
            return method(*args, **kwargs)
        except Exception as exc:
            self.metrics.tier_errors.labels(self.label, op).inc()
            logger.warning("tier %s: %s failed: %s", self.label, op, exc)
            return None
