"""An ordered list of storage tiers, fastest first, used as one store.

- ``put`` writes through to every tier that lacks the key: ``queue.mode: sync``
  tiers from the calling (store worker) thread, ``async`` tiers through the one
  bounded write queue the chain keeps for each (:mod:`kvplug.core.chain.write_queue`), so
  a slow S3 never delays what the CPU tier can serve. Reads answer from an async
  tier's queue first: what is queued for it is readable at once.
- ``fetch_prefix`` reads through: the first tier holding a chunk serves it (one ``get``
  per tier, no ``contains``: the first key no tier returns ends the prefix). It
  does not promote: ``promote`` writes a hit from a slower tier to the faster
  ones once the caller has verified it (:class:`kvplug.ChunkStore` does both).
- ``contains_prefix`` answers how many leading keys some tier holds.
- Admission: each tier's :class:`~kvplug.core.policies.admission.AdmissionPolicy` (``tiers[i].admission``)
  decides which chunks of a ``put`` or a ``promote`` are written to it, before the
  write is made or queued; stores and verified loads count as sightings, lookups do
  not. A load also writes the chunks a slower tier's policy has just admitted (they
  were declined when stored); see :mod:`kvplug.core.policies.admission`.
- A tier that raises is a miss for that call (logged and counted), never an error
  for the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any

from kvplug.core.chain.discards import DeferredDiscards
from kvplug.core.chain.opening import open_tiers, preflight_tiers
from kvplug.core.chain.reads import Fetched, fetch_prefix, holders, leading
from kvplug.core.chain.removal import RemovalPlan, RemoveKeys, TierRemoval, remove_planned, remove_read
from kvplug.core.chain.slot import TierSlot, WriteListeners
from kvplug.core.chain.write_queue import Items, WriteQueue
from kvplug.core.chain.writes import put_missing, write_promoted, write_put
from kvplug.core.events import KVEvent
from kvplug.core.metrics import EngineMetrics
from kvplug.core.plugins import PluginRegistry
from kvplug.core.policies.admission import make_admission_policy
from kvplug.core.tenancy import Tenancy
from kvplug.core.tier import Buffer, StorageTier, TierConfig, TierStats

if TYPE_CHECKING:
    from kvplug.core.tenant_metrics import TierFigures


class TierChain:
    """Tiers fastest first; see the module docstring for the semantics."""

    def __init__(
        self,
        tiers: Sequence[StorageTier],
        metrics: EngineMetrics | None = None,
        *,
        lookup_timeout_s: float | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a tier chain needs at least one tier")
        self.metrics = metrics or EngineMetrics()
        #: Budget of one lookup across every tier; past it, the rest is a miss.
        self.lookup_timeout_s = lookup_timeout_s
        self._slots: list[TierSlot] = []
        #: The pins and tenants its tiers share (:meth:`open` gives its tiers this one).
        self.tenancy = Tenancy()
        self._figures: TierFigures = lambda: [(label, stats.extra) for label, stats in self.stats()]
        self.metrics.tenants.sources.append(self._figures)
        #: Told which keys each write of the chain put in which tier: a clear tells its own records by it.
        self.writes = WriteListeners()
        #: Removals of chunks a load found unusable, off the loading thread (:meth:`discard_later`).
        self._discards = DeferredDiscards(
            functools.partial(remove_read, self._slots),
            lambda items, admission, only_trusted, skip: write_put(
                self._slots, items, admission=admission, only_trusted=only_trusted, skip=skip
            ),
            self.metrics.store_dropped.labels("discards").inc,
        )
        for index, tier in enumerate(tiers):
            label = f"{index}:{tier.name}"
            settings = tier.config
            queue = None
            if settings.queue.mode == "async":
                queue = WriteQueue(
                    f"kvplug-writer-{label}",
                    settings.queue,
                    functools.partial(self._put_missing_at, index),
                    settle=functools.partial(self._settle_at, index),
                    on_drop=self.metrics.store_dropped.labels(label).inc,
                )
            admission = make_admission_policy(settings.admission)
            self._slots.append(TierSlot(tier, settings, label, queue, self.metrics, admission, index, self.writes))

    @classmethod
    def open(
        cls,
        specs: Sequence[Any],
        registry: PluginRegistry,
        *,
        fingerprint: str | None = None,
        metrics: EngineMetrics | None = None,
        lookup_timeout_s: float | None = None,
        emit: Callable[[KVEvent], None] | None = None,
        tenancy: Tenancy | None = None,
        read_only: bool = False,
        max_record_bytes: int | None = None,
    ) -> TierChain:
        """Build each configured tier (``config.tiers`` entries, resolved) and chain them.

        The tiers report their events to ``emit`` (their engine's listeners; default:
        only the registry's ``kvplug_on_event`` observers). ``tenancy``: the engine's pins and
        tenants, shared by the tiers (default: none wanted, none known). ``read_only`` and
        ``max_record_bytes`` go to every tier's :class:`TierContext` (inspection; the bound).

        If one tier fails to open, the ones already opened are closed again, and the
        failure is a :class:`~kvplug.errors.TierOpenError` naming the entry
        (``tiers[1] (type disk): ...``); the tier's own exception is its ``cause``.
        """
        metrics = metrics or EngineMetrics()
        tenancy = tenancy or Tenancy()
        tiers = open_tiers(
            specs,
            registry,
            fingerprint=fingerprint,
            metrics=metrics,
            emit=emit,
            tenancy=tenancy,
            read_only=read_only,
            max_record_bytes=max_record_bytes,
        )
        chain = cls(tiers, metrics, lookup_timeout_s=lookup_timeout_s)
        chain.tenancy = tenancy
        return chain

    @staticmethod
    def preflight(specs: Sequence[Any], registry: PluginRegistry) -> None:
        """Run every configured tier's :meth:`StorageTier.preflight` (no side effects); the
        first failure is a :class:`~kvplug.errors.TierOpenError` naming its entry."""
        preflight_tiers(specs, registry)

    @property
    def tiers(self) -> list[StorageTier]:
        return [slot.tier for slot in self._slots]

    @property
    def settings(self) -> list[TierConfig]:
        """Each tier's :class:`~kvplug.TierConfig` settings."""
        return [slot.settings for slot in self._slots]

    @property
    def labels(self) -> list[str]:
        """Each tier's label, ``<index>:<type>``: unique in the chain (two ``disk`` folders are two
        tiers), as its per-tier metrics and stats name it."""
        return [slot.label for slot in self._slots]

    # --- reads ----------------------------------------------------------------------

    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are held by at least one tier, within the lookup budget."""
        present = self.contains_any(keys, budget_s=self.lookup_timeout_s)
        return next((i for i, found in enumerate(present) if not found), len(keys))

    def locate_prefix(self, keys: Sequence[str]) -> list[str]:
        """Name of the fastest tier holding each leading key, up to the first key none holds.

        Lets an adapter tell a prefix served from memory from one that needs a slow tier
        (an engine may load the latter in the background).
        """
        return leading(self.locate(keys))

    def locate(self, keys: Sequence[str]) -> list[str | None]:
        """Name of the fastest tier holding each key (None: none does), one batched
        ``contains`` per tier, within the lookup budget."""
        return [None if index is None else self._slots[index].tier.name for index in self._holders(keys)]

    def locate_labels(self, keys: Sequence[str]) -> list[str | None]:
        """:meth:`locate` naming each tier by its :attr:`labels` entry, which tells two tiers of one type apart."""
        return [None if index is None else self._slots[index].label for index in self._holders(keys)]

    def locate_indices(self, keys: Sequence[str]) -> list[int | None]:
        """:meth:`locate` giving each tier's index in the chain (which tells two tiers of one type apart)."""
        return self._holders(keys)

    def _holders(self, keys: Sequence[str]) -> list[int | None]:
        return self._unless_removed(keys, holders(self._slots, keys, self.metrics, budget_s=self.lookup_timeout_s))

    def contains_any(
        self, keys: Sequence[str], *, sync_tiers_only: bool = False, budget_s: float | None = None
    ) -> list[bool]:
        """Whether some tier holds each key.

        ``sync_tiers_only`` asks only the tiers written on the caller's side (not
        ``queue.mode: async``). The store path uses it to skip copying chunks that are
        already cached, without waiting on a remote store: an async tier's queue checks
        what the tier lacks again on its own thread before it writes.

        ``budget_s`` bounds the whole answer: remote tiers end their calls within it
        (:func:`kvplug.core.remote.calls.call_budget`), and tiers not asked before it ran out answer
        "miss".
        """
        skip = (lambda slot: slot.queue is not None) if sync_tiers_only else None
        where = holders(self._slots, keys, self.metrics, budget_s=budget_s, skip=skip)
        return [index is not None for index in self._unless_removed(keys, where)]

    def being_removed(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether each key's removal (found unusable) is on its way (``None``: no key's is):
        such a key is a miss, also to a lookup that asks the tiers itself."""
        return self._discards.being_removed(keys)

    def _unless_removed(self, keys: Sequence[str], where: list[int | None]) -> list[int | None]:
        """``where`` with the keys whose removal is on its way (found unusable) held by no tier."""
        removing = self._discards.being_removed(keys)
        return where if removing is None else [None if gone else index for index, gone in zip(where, removing)]

    def fetch_prefix(self, keys: Sequence[str]) -> list[Fetched]:
        """Values of the leading keys that some tier holds, each with the tier it came
        from; stops at the first key no tier returns.

        Each tier, fastest first, is asked one batched ``get`` of the keys no faster tier
        returned: a load costs one round trip per tier it reads, no ``contains`` (the
        lookup asked that already). A key that vanished since the lookup (evicted by
        another process) ends the prefix, a clean miss: what a slower tier returned past
        it is dropped. Nothing is promoted: the caller verifies the values and promotes
        only those that passed (:meth:`promote`), since a faster tier with
        ``trusted_reads`` must never hold bytes nobody checked. A key whose removal is on
        its way (found unusable) ends the prefix too."""
        removing = self._discards.being_removed(keys)
        if removing is not None and any(removing):
            keys = keys[: removing.index(True)]
        return fetch_prefix(self._slots, keys)

    def promote(self, keys: Sequence[str], fetched: Sequence[Fetched], *, only_trusted: bool = False) -> None:
        """After a verified load: write values found in slower tiers to the faster ones
        that admit them, and values a slower tier's admission policy admits from this
        load on (declined when they were stored) to that tier (``keys`` pair with
        ``fetched``). The load counts as a sighting of each key. ``only_trusted``: write
        only to the ``trusted_reads`` tiers (a replica's copies, see :meth:`put`)."""
        keys = list(keys[: len(fetched)])
        if keys:
            write_promoted(self._slots, keys, fetched, only_trusted=only_trusted)

    @property
    def all_trusted(self) -> bool:
        """Whether every tier has ``trusted_reads``: stored frames then never leave this process."""
        return all(slot.tier.trusted_reads for slot in self._slots)

    def discard(self, keys: Sequence[str]) -> None:
        """Remove keys from every tier (``store gc``, a test), cancelling their writes
        still queued; this thread waits for each tier's ``remove``."""
        self.remove(RemoveKeys(list(keys)))

    def discard_later(self, items: Sequence[tuple[str, Buffer]]) -> None:
        """Remove (key, value read) pairs a load found unusable on the chain's removal thread:
        never waits. Each tier removes a key only while it holds that value (a tier that cannot
        compare: by name); a later :meth:`put` of the key is written after its removal
        (:mod:`kvplug.core.chain.discards`)."""
        self._discards.discard(items)

    def remove(
        self, plan: RemovalPlan, *, tiers: Collection[int] | None = None, count: bool = False
    ) -> list[TierRemoval]:
        """Remove what ``plan`` says from the tiers at the indexes ``tiers`` (None: every
        tier): first the queued writes of its keys are cancelled (one being written lands
        first), those held back behind a removal of an unusable chunk too, then each tier
        removes its keys; see :mod:`kvplug.core.chain.removal`.
        ``count``: remove only the keys a tier holds, and measure the bytes freed."""
        self._discards.cancel_puts(plan.cancels(), tiers)
        return remove_planned(self._slots, plan, tiers=tiers, count=count)

    # --- writes ---------------------------------------------------------------------

    def put(self, items: Items, *, admission: bool = True, only_trusted: bool = False) -> None:
        """Write each item to every tier that admits it and does not hold its key yet.
        The put counts as a sighting of each key. ``admission=False`` writes to every
        tier, uncounted: for small records every tier must hold (fingerprint manifests).
        ``only_trusted``: only to the ``trusted_reads`` (process-private) tiers."""
        items = self._discards.hold_back(items, admission=admission, only_trusted=only_trusted)
        write_put(self._slots, items, admission=admission, only_trusted=only_trusted)

    def writes_pending(self, keys: Sequence[str]) -> list[bool]:
        """Whether a write of each key may still land in some tier, or be announced: queued for
        an ``async`` tier or being written, held back behind a removal of it, or landed with its
        ``stored`` not sent to the listeners yet (:meth:`StorageTier.stored_unsent`)."""
        pending = self._discards.holds_back(keys)
        for slot in self._slots:
            if slot.queue is not None:
                pending = [a or b for a, b in zip(pending, slot.queue.holds(keys))]
            # After the queue: a write it hands to the tier is held there before it leaves the queue.
            pending = [a or b for a, b in zip(pending, slot.tier.stored_unsent(keys))]
        return pending

    def _put_missing_at(self, index: int, items: Items) -> None:
        put_missing(self._slots[index], items)

    def _settle_at(self, index: int) -> None:
        self._slots[index].settle()

    # --- lifecycle ------------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every accepted write (and removal of an unusable chunk) is visible in its tier."""
        self._discards.flush()
        for slot in self._slots:
            if slot.queue is not None:
                slot.queue.flush()
            slot.flush()

    def stats(self) -> list[tuple[str, TierStats]]:
        result = []
        for slot in self._slots:
            stats = slot.stats() or TierStats(errors=-1)
            if slot.queue is not None:
                stats.extra["writer_dropped"] = slot.queue.dropped
                stats.extra["writer_pending"] = slot.queue.pending()
            result.append((slot.label, stats))
        return result

    def discard_queued_writes(self) -> int:
        """Drop (counted) the batches every tier's write queue holds and has not begun to
        write, and the removals of unusable chunks (and puts held back behind them) not
        begun, also while :meth:`close` drains them on another thread: a close that waits
        on a tier whose write or removal does not finish then ends when that call returns,
        not after every queued one. Returns how many batches and removals were dropped."""
        dropped = self._discards.discard_queued()  # first: their held-back puts would go to the queues
        return dropped + sum(slot.queue.discard_queued() for slot in self._slots if slot.queue is not None)

    def close(self, *, drain: bool = True) -> None:
        """Close every tier, after its write queue has written (``drain`` and the
        queue's ``on_close: drain``) or dropped what is queued."""
        if self._figures in self.metrics.tenants.sources:
            self.metrics.tenants.sources.remove(self._figures)
        self._discards.close(drain=drain)  # first: its held-back puts go to the write queues
        for slot in self._slots:
            if slot.queue is not None:
                slot.queue.close(drain=drain)
            slot.close()
