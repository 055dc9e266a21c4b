"""The storage tier contract: opaque bytes under string keys. No torch here."""

from __future__ import annotations

import logging
import mmap
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ByteSize, Field, model_validator

from kvplug.core.components import ComponentConfig
from kvplug.core.events import KVEvent
from kvplug.core.metrics import EngineMetrics
from kvplug.core.policies.admission import AdmissionConfig, AdmitAllConfig
from kvplug.core.queue_settings import QueueSettings, complete_queue
from kvplug.core.tenancy import Tenancy

#: What ``get`` returns for a key: the whole value, or ``None`` for a miss.
Buffer = bytes | bytearray | memoryview


class MappedFile(mmap.mmap):
    """A read-only mapping of a file in a store that processes share (tier ``shm``'s
    record files), whose views a tier's ``get`` may return instead of a copy.

    A view of it keeps the file's pages in memory after the file is unlinked (evicted),
    where no budget counts them and no eviction can free them: a tier that keeps the
    buffers it is given (:attr:`StorageTier.keeps_buffers`) copies such a value
    (:func:`is_mapped_file`) instead of keeping the view."""


def is_mapped_file(value: Buffer) -> bool:
    """Whether ``value`` is a view of a :class:`MappedFile`."""
    return isinstance(value.obj if isinstance(value, memoryview) else value, MappedFile)


#: Where a tier keeps its values (:attr:`StorageTier.medium`), fastest first.
Medium = Literal["memory", "disk", "remote"]
#: The media in order of speed: adapters rank tiers by it, never by tier name.
MEDIA: tuple[Medium, ...] = ("memory", "disk", "remote")
#: A ``max_bytes`` that never binds (2**62), for a tier whose config needs a number where
#: nothing may be evicted: :meth:`StorageTier.location_config` opens stores with it for
#: inspection. Displays show it, and any budget above it, as "unbounded".
UNBOUNDED_BYTES = 2**62


class TierConfig(ComponentConfig):
    """Options every tier understands. Tier ``Config`` classes subclass it.

    A subclass gives its tiers other queue defaults by redeclaring ``queue`` with another
    default (``RemoteTierConfig``: async); a user's partial ``queue:`` mapping changes only
    the keys it names.
    """

    max_bytes: ByteSize | None = Field(default=None, description="Byte budget of stored values; None means unbounded.")
    queue: QueueSettings = Field(
        default_factory=QueueSettings,
        description="How the tier chain writes this tier: sync, from the store worker's thread, or async, through "
        "a bounded write queue of the chain's own (values queued there are readable at once; a store does "
        "not ask an async tier what it holds until its queue writes).",
    )
    admission: AdmissionConfig = Field(
        default_factory=AdmitAllConfig,
        description="Which chunks the tier chain writes to this tier: {type: all} every chunk; {type: frequency, "
        "min_hits: 2} a chunk once it was stored or loaded min_hits times (lookups do not count), so one-off "
        "prompts never reach the tier. Written and declined chunks are counted (kvplug_admission_*_total).",
    )

    @model_validator(mode="before")
    @classmethod
    def _complete_queue(cls, data: Any) -> Any:
        return complete_queue(cls, data)


@dataclass
class TierStats:
    """Counters of one tier. ``bytes_used`` counts value bytes (not record headers).

    ``bytes_used`` and ``items`` are exact for a tier that owns its storage. A tier on a
    server that evicts on its own (valkey) can only estimate them from what this process
    stored and read; it says so with ``extra["items_are"] = "estimate"``."""

    bytes_used: int = 0
    items: int = 0
    hits: int = 0
    misses: int = 0
    puts: int = 0
    evictions: int = 0
    errors: int = 0
    extra: dict[str, int | float | str] = field(default_factory=dict)


@dataclass
class TierContext:
    """What a tier gets from the engine besides its own config."""

    tier_index: int = 0
    fingerprint: str | None = None
    logger: logging.Logger = field(default_factory=lambda: logging.getLogger("kvplug.tier"))
    #: The engine's metrics; remote tiers report breaker state and failures there.
    metrics: EngineMetrics = field(default_factory=EngineMetrics)
    #: Report events (``stored``, ``evicted``, ``removed``) to the engine's listeners and
    #: ``kvplug_on_event`` observers; a chain's tier gets one that sets ``KVEvent.tier_index``.
    emit: Callable[[KVEvent], None] = lambda event: None
    #: The engine's wanted pins and the tenants (cache_salts) of key fingerprints, shared by its tiers.
    tenancy: Tenancy = field(default_factory=Tenancy)
    #: Opened by an inspection command (``kvplug store stats|ls|verify``, ``kvplug explain``):
    #: the tier creates, changes and deletes nothing in its store (no folders, bookkeeping
    #: files, cleanup, timestamps); a write or removal fails.
    read_only: bool = False
    #: The largest record (header and value) the engine can store or read: a tier that
    #: learns a record's size before reading it (a file's) treats a larger one as corrupt
    #: rather than allocate it. ``None``: no bound. The engine raises it when another cache
    #: (a hybrid model's group) shares the tiers; read it when a record is read.
    max_record_bytes: int | None = None


class StorageTier(ABC):
    """A store of byte buffers under string keys (``<version>/<fingerprint>/<hash>``).

    Methods are batched and thread-safe. ``put`` is atomic per key: a reader sees
    the whole value or nothing, even if the process dies mid-write. ``put`` may
    keep a reference to the buffers it is given: the caller hands them over and
    must not modify them afterwards. ``get`` returns read-only data.
    """

    name: ClassVar[str]
    #: The tier's options, a :class:`TierConfig` subclass: the chain reads the settings
    #: every tier has (``max_bytes``, ``queue`` ...) from it.
    Config: ClassVar[type[TierConfig]] = TierConfig
    #: Where the values live: ``memory`` (this process's or this host's memory, read at
    #: memory speed), ``disk`` (local files) or ``remote`` (another machine or service).
    #: Engine adapters treat tiers by this trait, never by their names: a prefix held
    #: only by tiers not in memory may load in the background, an engine's prefix cache
    #: reset clears the memory tiers, KV events carry the medium. A tier
    #: that does not declare it (written against kvplug 0.2) counts as ``remote``, the
    #: safe assumption: its reads may be slow, and a reset leaves it alone.
    medium: ClassVar[Medium] = "remote"
    #: True for tiers whose ``contains`` costs microseconds and never waits on a network
    #: or another process (a ``stat`` of a local file): engine adapters then ask it on
    #: their latency-critical thread (an engine's scheduler) rather than in the background,
    #: where an answer waits for the engine's next step. Tiers of medium ``memory``
    #: count as such whatever they declare.
    inline_lookups: ClassVar[bool] = False
    #: True for tiers that keep the very buffers ``put`` hands them (in-memory
    #: tiers): the engine sizes its frame pool to cover their ``max_bytes``. Such a tier
    #: copies a value that is a view of a :class:`MappedFile` (:func:`is_mapped_file`):
    #: kept, the view would hold a shared file's pages after the file is evicted.
    keeps_buffers: ClassVar[bool] = False
    #: True for tiers whose ``get`` returns the very bytes ``put`` was given in this
    #: process (process memory, nothing in between that could change them): the engine
    #: then neither checksums frames that only such tiers hold nor re-verifies frames
    #: read from them. Bytes that leave the process (files, shared memory, the network)
    #: are sealed and verified.
    trusted_reads: ClassVar[bool] = False
    #: True for tiers whose ``get`` checks every byte of each value it returns against a
    #: checksum (or MAC) written with it, and returns a miss otherwise: the record tiers,
    #: whose record checksum covers the whole value. The engine then does not checksum
    #: the frame a second time (it still checks the frame's header, shape and dtype):
    #: one pass over the bytes instead of two, on the path of every load from outside
    #: the process. (Tier ``shm`` with ``trust_host`` skips its own pass too, by its
    #: operator's choice: docs/security.md.) Leave it off for a tier that returns what
    #: its store returns unchecked.
    verified_reads: ClassVar[bool] = False
    #: True for tiers that report each ``put`` themselves: a ``stored`` :class:`~kvplug.KVEvent`
    #: (``tier`` = :attr:`name`) naming the keys the put left in the tier, emitted before the
    #: ``evicted`` event of what that put pushed out (so a router is never told "stored" last for
    #: a key the same put evicted), and never for a value the tier refused or failed to write.
    #: For a tier that leaves it off (written against kvplug 0.2), the tier chain reports the
    #: keys of each ``put`` that returned without raising.
    reports_stored: ClassVar[bool] = False

    def __init__(self, config: TierConfig, context: TierContext) -> None:
        self.config: TierConfig = config
        self.context = context

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> BaseModel | None:
        """The config that opens ``location`` for ``kvplug store`` (inspection: an
        unbounded budget, nothing evicted), or ``None`` when this tier does not store
        things at such a location. ``options`` are extra settings from the command
        line (``kvplug store -o endpoint_url=...``); raise ``ValueError`` naming any this tier lacks.
        A tier that answers must implement ``kvplug.RecordStore``."""
        return None

    @classmethod  # noqa: B027 - a no-op: most tiers can tell only by opening
    def preflight(cls, config: BaseModel) -> None:
        """Check, without side effects, what can be known before an engine starts: a
        folder that cannot be created, a path under a file. Raise an exception whose
        message says what is wrong; the caller names the entry (``tiers[1] (type disk)``).

        Engine adapters call it where the engine validates its own configuration, before
        the model loads, so a config that cannot work fails in seconds rather than after
        the model load. It must be cheap and must not create, connect or scan anything:
        what only opening the tier can tell is still found by the constructor.
        """

    @abstractmethod
    def contains(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored."""

    @abstractmethod
    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        """The value of each key, or ``None`` where it is missing."""

    @abstractmethod
    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        """Store each value under its key, replacing any older value."""

    @abstractmethod
    def remove(self, keys: Sequence[str]) -> None:
        """Remove the keys; missing keys are ignored."""

    def remove_if_same(self, items: Sequence[tuple[str, Buffer]]) -> None:
        """Remove each key only while the tier still holds the value given with it (the
        bytes a ``get`` returned, which a load then found unusable); a key another writer
        stored again since keeps its new value. The check and the removal should be one
        step against that tier's writers (other processes' too). The default removes by
        name (:meth:`remove`): a good value stored in the window is lost (a miss, never
        wrong data). Override where the tier can compare and delete at once."""
        self.remove([key for key, _ in items])

    @abstractmethod
    def stats(self) -> TierStats:
        """A snapshot of the tier's counters."""

    def flush(self) -> None:  # noqa: B027 - a no-op for tiers whose puts are visible at once
        """Wait until every ``put`` accepted so far is visible to ``get``."""

    def settle(self) -> None:  # noqa: B027 - a hook: most tiers defer nothing
        """Hook: the tier chain has nothing more to write to this tier for now. It calls it
        when the tier's write queue runs empty and after each put written from the
        caller's thread, so a tier can group work over the puts of a busy queue instead
        of doing it in every put (the disk tier fsyncs the folders it renamed into here).
        Must not wait long: the queue's thread runs it. The default does nothing."""

    def stored_unsent(self, keys: Sequence[str]) -> list[bool]:
        """Whether a ``stored`` event of each key is still on its way to the listeners: its put
        landed, the event is queued behind another thread's delivery (:class:`~kvplug.OrderedEvents`
        ``.stored_unsent``, which a tier that queues its events returns). Until it is sent the
        write counts as in flight (:meth:`CacheEngine.writes_in_flight
        <kvplug.CacheEngine.writes_in_flight>`). The default: none (events sent by the putting thread)."""
        return [False] * len(keys)

    def pin(self, keys: Sequence[str]) -> list[tuple[str, int]] | None:
        """Take stored keys out of eviction, within the tier's pin budget: per key, what
        happened (``pinned``, ``already``, ``refused``, ``missing``) and its bytes. ``None``:
        this tier keeps no pins (the default). Tiers that keep them also pin every key
        ``context.tenancy.pins`` wants when they store it."""
        return None

    def unpin(self, keys: Sequence[str]) -> list[int | None] | None:
        """Make pinned keys evictable again: per key its bytes, or ``None`` where it was not
        pinned. ``None``: this tier keeps no pins (the default)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Release resources. Idempotent; later calls raise ``TierClosedError``."""

    def __enter__(self) -> StorageTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
