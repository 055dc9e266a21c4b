"""What a record tier's backend implements: a few batched primitives that speak one store.

A :class:`~kvplug.core.records.tier.RecordTier` owns everything a store has in common
(framing and verification, corrupt and incompatible records, the size index and budget,
events, counters, deadlines, retries and the circuit breaker). Its backend only moves
whole records: named by hex digests, already framed, never interpreted. Each primitive
is a coroutine that handles one batch, run on the tier's event loop under one deadline
per attempt; the tier splits big batches by :attr:`RecordBackend.call_sizes` and runs the
pieces concurrently. A primitive signals a missing record by its result (``None``,
``False``) or, for a batch of one, by raising ``FileNotFoundError`` or
:class:`kvplug.Absent`; any other exception fails the whole batch (counted, retried when
:meth:`RecordBackend.classify` says it is transient). Where the store answers per name
and fails on some names only, :meth:`~RecordBackend.sizes`, :meth:`~RecordBackend.exists`,
:meth:`~RecordBackend.read`, :meth:`~RecordBackend.peek` and :meth:`~RecordBackend.delete`
put an exception instance in those names' slots: no answer for that name, like a failed
batch for it alone (a miss, nothing forgotten, a removal that failed), without failing
the others or counting towards the breaker. A :class:`kvplug.errors.CorruptChunkError` in
a slot of :meth:`~RecordBackend.read` or :meth:`~RecordBackend.peek` is an answer: the
record is bad, found so before it was read (a file whose size its header or
:attr:`kvplug.TierContext.max_record_bytes` rules out; :func:`kvplug.check_record_size`),
and is counted, logged and removed like a record that fails verification. A corrupt record
is removed only through :meth:`~RecordBackend.delete_if_same` (never by name alone: a good
record stored there meanwhile by another process must survive).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kvplug.core.records.store import StoredRecord
from kvplug.core.remote.retry import FailureKind, classify_failure
from kvplug.core.tier import Buffer

#: What :meth:`RecordBackend.sizes` answers for a record it knows is there but not how big.
SIZE_UNKNOWN = -1


@dataclass(frozen=True)
class RecordToWrite:
    """One record for :meth:`RecordBackend.write`: its name, its 64-byte header and the value.

    A backend writes ``header`` then ``value`` as one object, however suits its store:
    :meth:`joined` copies both into one buffer; a store with registered memory frames
    them straight into it."""

    name: str
    header: bytes
    value: memoryview

    @property
    def size(self) -> int:
        """Bytes of the stored record (header and value)."""
        return len(self.header) + self.value.nbytes

    def joined(self) -> bytes:
        """Header and value in one new buffer (the value copied once)."""
        return b"".join((self.header, self.value))


@dataclass(frozen=True)
class CallSizes:
    """How many records one call of each primitive takes; bigger batches are split and
    the pieces run concurrently (``max_concurrency`` at a time). An object store that
    has one request per object uses 1; a server with pipelines uses its pipeline size."""

    #: Names per :meth:`RecordBackend.sizes`, :meth:`~RecordBackend.exists` and
    #: :meth:`~RecordBackend.delete` call (small replies).
    query: int = 1024
    #: Names per :meth:`RecordBackend.read` call.
    read: int = 64
    #: Records per :meth:`RecordBackend.write` call ...
    write: int = 64
    #: ... and bytes per call (a call holds at least one record).
    write_bytes: int = 64 * 1024**2


class RecordBackend(ABC):
    """Speaks one store for a :class:`~kvplug.core.records.tier.RecordTier`; see the module docstring.

    Every primitive is a coroutine run on the tier's event loop. A blocking client
    library runs its calls in a thread pool of the backend's own
    (``loop.run_in_executor``), so deadlines still hold."""

    #: Batch sizes per primitive (see :class:`CallSizes`).
    call_sizes: CallSizes = CallSizes()
    #: True for stores that remove records on their own (a server's ``maxmemory``
    #: policy): the tier then checks a few indexed records against :meth:`exists` after
    #: each write, so its index and ``stats()`` do not keep records long gone.
    evicts_on_its_own: ClassVar[bool] = False
    #: True for a backend that keeps the tier's ``max_bytes`` itself, over a store that
    #: several processes share (one budget for all of them, kept in the store: the disk
    #: tier's folder ledger, a shared-memory segment's header). Its :meth:`write` makes
    #: room as it stores, and :meth:`take_evicted` reports what it removed; the tier
    #: then counts those evictions and reports them as ``evicted`` events with the key
    #: texts it knows. The tier's own index only gives size hints, ``stats()`` and key
    #: texts: it never deletes by its own LRU (an index full at ``index_max_keys``
    #: forgets its least recently used entries, counted as ``index_dropped_full``).
    keeps_budget: ClassVar[bool] = False
    #: What a listed record's time (:attr:`StoredRecord.modified`) is, in the words ``kvplug store
    #: ls`` heads its column with: ``written``, or ``last used`` for a store whose reads move it
    #: (an mtime the tier's LRU eviction bumps on every read).
    listed_time: ClassVar[str] = "written"
    #: True for a backend whose primitives only make local system calls (files, shared
    #: memory) and never suspend: the tier runs them on the calling thread, one call
    #: after another, without its event loop, deadlines, retries or breaker (a deadline
    #: cannot stop a system call, and two thread hops per call would cost more than a
    #: read from the page cache). Such a backend is thread-safe and runs its own threads
    #: where calls should overlap. ``open``, ``listing``, ``flush`` and ``close`` still
    #: run on the tier's loop.
    runs_inline: ClassVar[bool] = False
    #: Deadline of :meth:`open`, when it differs from the tier's ``request_timeout_s``.
    open_timeout_s: float | None = None

    #: Where the store is, for messages and ``stats()`` (no credentials).
    where: str = ""

    def classify(self, exc: BaseException) -> FailureKind:
        """Whether an exception means a missing record (``absent``), a failure worth a
        retry (``transient``) or one that is not (``permanent``)."""
        return classify_failure(exc)

    async def open(self) -> None:  # noqa: B027 - most stores connect on first use
        """Connect or prepare the client. A failure is logged, not fatal: later calls retry."""

    @abstractmethod
    async def sizes(self, names: Sequence[str]) -> Sequence[int | None | BaseException]:
        """The stored size of each record, ``None`` where there is none (or
        :data:`SIZE_UNKNOWN` where the store knows it is there but not its size)."""

    async def exists(self, names: Sequence[str]) -> Sequence[bool | BaseException]:
        """Whether each record is stored. Used for the index's round of checks on stores
        that evict on their own; override with a call that does not count as a use of
        the record (a server's LRU data) where the store has one."""
        return [size if isinstance(size, BaseException) else size is not None for size in await self.sizes(names)]

    @abstractmethod
    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> Sequence[Buffer | None | BaseException]:
        """Each record's bytes (header and value), ``None`` where there is none.
        ``sizes`` are the expected record sizes where the tier knows them (a store that
        reads into pre-sized buffers uses them; others ignore them)."""

    async def peek(self, names: Sequence[str], sizes: Sequence[int | None]) -> Sequence[Buffer | None | BaseException]:
        """Read for inspection (``kvplug store``, ``kvplug explain``): must not count as a
        use of the records. :meth:`read` by default; override where a read counts as one
        (the disk tier's file mtimes and eviction order)."""
        return await self.read(names, sizes)

    @abstractmethod
    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        """Store each record whole (a reader sees all of it or none, even if the writer
        dies), replacing an older one. Per record: ``None`` when stored, or the exception
        that says why not (the store is full: the record is dropped and counted)."""

    @abstractmethod
    async def delete(self, names: Sequence[str]) -> Sequence[bool | BaseException]:
        """Remove the records; per name, whether there was one."""

    async def delete_if_same(
        self, names: Sequence[str], seen: Sequence[Buffer | None]
    ) -> Sequence[bool | BaseException]:
        """Remove each corrupt record only if the store still holds what was read of it;
        per name, whether it was removed.

        ``seen[i]`` is the bytes a read returned, or ``None`` for a record found bad
        unread (a :class:`kvplug.errors.CorruptChunkError` in its slot: remove it only if
        the store would still find it so). The check and the removal must be one step
        against writes of the same name by every process that shares the store: another
        process may have stored a good record there since it was read, and removing that
        would be a lost hit for all of them. The default removes nothing, which is always
        safe: the tier then treats the name as absent in this process (lookups miss, so the
        engine stores it again, over the bad one). Override where the store can compare
        and delete at once (a lock every writer takes, a script run atomically, a
        conditional request). A ``BlockingIOError`` in a name's slot says the store is busy
        (a lock another process holds): a read does not wait for it, ``kvplug store gc``
        asks again."""
        return [False] * len(names)

    async def listing(self) -> list[StoredRecord]:
        """Every record of the store (for the start-up scan and ``kvplug store``).
        Stores that cannot list leave it: the tier then indexes what it writes and reads."""
        raise NotImplementedError(f"{type(self).__name__} cannot list its store")

    async def flush(self) -> None:  # noqa: B027 - most stores are durable when a write returns
        """Finish work deferred over writes (the disk tier's grouped folder fsyncs).
        Called by the tier's ``flush``."""

    def take_evicted(self) -> list[StoredRecord]:
        """For :attr:`keeps_budget` backends: the records removed to keep the budget since
        the last call (name and stored size; ``modified`` may be 0). Called from any thread."""
        return []

    def errors(self) -> int:
        """Failures the backend counted itself instead of raising (a record it could not
        read, an fsync that failed), added to ``stats().errors``."""
        return 0

    async def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release the client. Called once, on the tier's loop, after every call ended."""

    def describe(self) -> dict[str, int | float | str]:
        """Extra ``stats()`` entries of this store (its address, its own counters)."""
        return {}

    @property
    def deletes_if_same(self) -> bool:
        """Whether this backend implements :meth:`delete_if_same` (else corrupt records stay)."""
        return type(self).delete_if_same is not RecordBackend.delete_if_same

    @property
    def can_list(self) -> bool:
        """Whether this backend implements :meth:`listing`."""
        return type(self).listing is not RecordBackend.listing
