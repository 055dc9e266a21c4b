"""Removing chunks a load found unusable without the loading thread waiting for it.

A load that finds a corrupt chunk reports a miss at once. Removing the chunk from the
tiers is a tier's ``remove`` (a remote one may hang until its deadline), so it is done by
one worker thread per chain, whatever the store queue's mode and whoever loads (a
``CacheEngine``, or an adapter that uses :class:`~kvplug.ChunkStore` directly). The
removal carries the bytes the load read: each tier removes the key only while it still
holds them (:meth:`~kvplug.StorageTier.remove_if_same`), so a good record another process
stored under that key since survives where the tier can compare and delete at once.

Until its removal is done, a key is a miss to the chain's lookups and loads (they would
find the unusable value again), and a store does not take it for stored.

Order: a put of a key whose removal is queued or in progress goes through the same
worker, after the removal, so a removal never deletes a store asked for after it, and
the putting thread does not wait for it either. A put that began before the removal was
asked for may still be removed by it (a miss, never wrong data).

Bounded: the worker holds at most :data:`MAX_JOBS` jobs and :data:`MAX_BYTES` of values
(read, or held back); past that a removal is shed (the chunk is a miss each time it is loaded, until a
later load's removal lands) and a held-back put is dropped and counted.

Forgotten like a write queue's writes: a removal by name (a clear, a cache reset) cancels
the held-back puts of its keys to the tiers it clears (:meth:`DeferredDiscards.cancel_puts`),
so a store asked for before it never lands after it (and still reaches the tiers not cleared); a close that gives up drops what is queued
(:meth:`DeferredDiscards.discard_queued`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from kvplug.core.background import BackgroundWorker
from kvplug.core.chain.write_queue import Items
from kvplug.core.tier import Buffer

logger = logging.getLogger("kvplug.tiers")

#: Bounds of the removal worker's queue: jobs, and bytes of the values in them.
MAX_JOBS = 1024
MAX_BYTES = 64 * 1024**2
#: Longest :meth:`DeferredDiscards.cancel_puts` waits for a held-back put being written.
CANCEL_WAIT_S = 30.0


@dataclass
class _Job:
    """Values read to remove from every tier that still holds them, or a put held back
    behind such a removal."""

    removes: Items = field(default_factory=list)
    puts: Items = field(default_factory=list)
    admission: bool = True
    only_trusted: bool = False
    #: The tiers (indexes) a clear of only some tiers took a key's put away from.
    cleared: dict[str, frozenset[int]] = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(memoryview(value).nbytes for _, value in [*self.removes, *self.puts])


class DeferredDiscards:
    """A chain's removals of unusable chunks, on a worker thread started at the first one.

    ``remove(items)`` removes each (key, value read) from every tier still holding that value;
    ``put(items, admission, only_trusted, skip)`` is the chain's put, for the puts held back
    (``skip``: indexes of tiers it does not write to);
    ``on_put_dropped()`` counts a held-back put the full or closed queue refused.
    """

    def __init__(
        self,
        remove: Callable[[Items], None],
        put: Callable[[Items, bool, bool, frozenset[int]], None],
        on_put_dropped: Callable[[], None],
    ) -> None:
        self._remove = remove
        self._put = put
        self._on_put_dropped = on_put_dropped
        # Re-entrant: a submit the worker refuses calls _dropped on this thread, lock held.
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)  # a held-back put was written
        self._removing: set[str] = set()  # keys whose removal is queued or in progress
        self._held: list[_Job] = []  # jobs of held-back puts, queued (not begun)
        self._in_hand: _Job | None = None  # the job the worker is doing
        self._putting: set[str] = set()  # keys of its held-back put
        self._worker: BackgroundWorker[_Job] | None = None
        self._closed = False

    def discard(self, items: Sequence[tuple[str, Buffer]]) -> None:
        """Remove each key, while a tier holds the value read, on the worker; never waits."""
        with self._lock:
            # A copy: the value may be a view of a tier's buffer, reused once released.
            new: Items = [
                (key, bytes(memoryview(value))) for key, value in dict(items).items() if key not in self._removing
            ]
            if not new:
                return  # a removal of each is already on its way
            worker = self._started()
            if worker is None:
                logger.warning("tier chain closed: unusable chunks %s not removed", [key for key, _ in new])
                return
            self._removing.update(key for key, _ in new)
            # Submitted under the lock: a put that sees these keys queues behind this job.
            worker.submit(_Job(removes=new), wait=False)

    def being_removed(self, keys: Sequence[str]) -> list[bool] | None:
        """Whether each key's removal is queued or in progress (``None``: no key's is). Such a
        key is a miss to lookups and loads, and a store does not take it for stored."""
        with self._lock:
            if not self._removing:
                return None
            return [key in self._removing for key in keys]

    def hold_back(self, items: Items, *, admission: bool, only_trusted: bool) -> Items:
        """Queue the items whose key is being removed behind that removal; returns the
        others, for the caller to put now."""
        with self._lock:
            if not self._removing:
                return items
            later = [item for item in items if item[0] in self._removing]
            if not later:
                return items
            now = [item for item in items if item[0] not in self._removing]
            assert self._worker is not None  # something is being removed
            job = _Job(puts=later, admission=admission, only_trusted=only_trusted)
            self._held.append(job)  # before submit: one it refuses is taken out again (_done)
            self._worker.submit(job, wait=False)
        return now

    def holds_back(self, keys: Sequence[str]) -> list[bool]:
        """Whether a put of each key is held back behind a removal, or being written."""
        with self._lock:
            held = {key for job in self._held for key, _ in job.puts} | self._putting
        return [key in held for key in keys]

    def cancel_puts(self, keys: Sequence[str], tiers: Collection[int] | None = None) -> list[str]:
        """Forget the held-back puts of ``keys`` (a removal of them by name follows) to the tiers
        at the indexes ``tiers`` (``None``: every tier; the others are still written); wait (up to
        :data:`CANCEL_WAIT_S`) for one of them being written, so the removal comes after it.
        Returns the keys whose held-back put was forgotten (for those tiers)."""
        wanted = set(keys)
        cancelled: list[str] = []
        deadline = time.monotonic() + CANCEL_WAIT_S
        with self._lock:
            for job in self._held:
                cancelled += [key for key, _ in job.puts if key in wanted]
                if tiers is None:
                    job.puts = [item for item in job.puts if item[0] not in wanted]
                    continue
                for key, _ in job.puts:
                    if key in wanted:
                        job.cleared[key] = job.cleared.get(key, frozenset()) | frozenset(tiers)
            while self._putting & wanted:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("a held-back put of a removed key is still being written")
                    break
                self._changed.wait(left)
        return cancelled

    def discard_queued(self) -> int:
        """Drop what is queued and not begun (removals shed, held-back puts counted), also
        while a draining :meth:`close` waits; returns how many jobs."""
        with self._lock:
            worker = self._worker
        return 0 if worker is None else worker.discard_queued()

    def flush(self) -> None:
        """Wait until every removal and held-back put so far is done."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.flush()

    def close(self, *, drain: bool = True) -> None:
        """Stop the worker, after what is queued (``drain``) or dropping it; later
        removals are not done and later held-back puts are dropped."""
        with self._lock:
            self._closed = True
            worker = self._worker
        if worker is not None:
            worker.close(drain=drain)

    def _started(self) -> BackgroundWorker[_Job] | None:
        if self._worker is None and not self._closed:
            self._worker = BackgroundWorker(
                "kvplug-discards",
                self._handle,
                max_items=MAX_JOBS,
                max_bytes=MAX_BYTES,
                size_of=_Job.nbytes,
                on_full="drop",
                on_drop=self._dropped,
            )
        return None if self._closed else self._worker

    def _handle(self, job: _Job) -> None:
        with self._lock:  # begun: a cancel of its keys from now on waits for it
            puts = job.puts
            self._in_hand, self._putting = job, {key for key, _ in puts}
            self._unhold(job)
        try:
            if job.removes:
                self._remove(job.removes)
            by_skip: dict[frozenset[int], Items] = {}  # (one group, but where a clear of some tiers came)
            for key, value in puts:
                by_skip.setdefault(job.cleared.get(key, frozenset()), []).append((key, value))
            for skip, group in by_skip.items():
                self._put(group, job.admission, job.only_trusted, skip)
        finally:
            self._done(job)

    def _dropped(self, job: _Job) -> None:
        if job.removes:  # shed: each load of the chunk is a miss until a later removal lands
            keys = [key for key, _ in job.removes]
            logger.warning("removal queue full or closed: unusable chunks %s not removed now", keys)
        if job.puts:
            self._on_put_dropped()
        self._done(job)

    def _done(self, job: _Job) -> None:
        with self._lock:
            self._removing.difference_update(key for key, _ in job.removes)
            self._unhold(job)
            if self._in_hand is job:  # (not one dropped from the queue meanwhile)
                self._in_hand, self._putting = None, set()
                self._changed.notify_all()

    def _unhold(self, job: _Job) -> None:
        """Take ``job`` out of the queued held-back puts (lock held)."""
        for index, held in enumerate(self._held):
            if held is job:
                del self._held[index]
                return
