"""Options of tier ``disk``.

Writes go through the tier chain's write queue for this tier (``queue``, async by
default), like every async tier's: values still queued are readable at once, repeated
writes of one key are coalesced, a ``remove`` cancels queued writes, and ``close``
writes or drops what is queued (``queue.on_close``). The tier's own ``put`` writes
before it returns; the chain calls its ``settle`` when the queue runs empty, which
fsyncs the folders renamed into since the last one as a group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ByteSize, Field, field_validator, model_validator

from kvplug import (
    Bounded,
    EvictionName,
    QueueSettings,
    RecordTierConfig,
    TenancySettings,
    ThreadCount,
    TimeoutSeconds,
    bound_share,
    parse_share,
)

#: The largest share of ``max_bytes`` every process's pins together may take, in percent: the
#: rest is for records that can be evicted, or a folder full of pins would refuse every store.
MAX_FOLDER_PIN_PERCENT = 90
#: What the rest of ``max_bytes`` beside ``folder_pin_max_bytes`` is for (said when it is too much).
_UNPINNED = "records that can be evicted"


class DiskTierConfig(TenancySettings, RecordTierConfig):
    """Options of tier ``disk``; ``path`` is required."""

    path: Path = Field(
        description="Folder of the cache, created if missing. Several processes may share it. A relative path "
        "is taken from the working directory of the process that reads the config (the engine's), not from the "
        "config file's folder: give an absolute path where they differ."
    )
    max_bytes: ByteSize = Field(
        default=ByteSize(16 * 1024**3),
        description="Byte budget of stored values (each file also holds a 64-byte record header).",
    )
    fsync: bool = Field(
        default=True,
        description="fdatasync each file before it is renamed into place, and the folder after. "
        "Off: a power loss (not a process crash) may lose recent writes; never tears one.",
    )
    queue: QueueSettings = Field(
        default_factory=lambda: QueueSettings(mode="async", max_items=64),
        description="How the tier chain writes this tier; async by default: from a bounded write queue, "
        "whose values are readable at once (queued values are held in memory until written).",
    )
    scan_on_start: bool = Field(
        default=True, description="List the folder on start, before the tier serves, so stats include its records."
    )
    # Local file I/O cannot be cancelled: a deadline would only report a write that still lands.
    request_timeout_s: TimeoutSeconds = Field(
        default=600.0, description="Deadline of one call (a put's records, a get's reads) on the folder."
    )
    retries: int = Field(default=0, ge=0, le=10, description="Retries after a failed call (file errors are not).")
    eviction: EvictionName = Field(
        default="lru",
        description="Which records max_bytes deletes first: lru (least recently used) or s3fifo "
        "(scan-resistant: a record read at least twice outlives a scan of one-off prompts; Yang et al., "
        "SOSP 2023). The order is each process's own, over the records it knows: at start every record "
        "listed enters cold, oldest file mtime first to leave (writes and hits set mtimes); then its own "
        "writes and hits. The budget stays one for the folder, shared by every process using it.",
    )
    write_threads: ThreadCount = Field(
        default=4,
        description="Records of one put written at once, so that their fdatasyncs overlap (each record is "
        "still renamed into place in the order it was put, after its own write). "
        "1: one at a time.",
    )
    stale_temp_s: Annotated[float, Bounded(0, 7 * 86400, "seconds", exclusive_minimum=True, note="a week")] = Field(
        default=600.0,
        description="A temporary file this old is a leftover of a killed writer and is removed at start "
        "(one whose writer process on this host, in this PID namespace, is gone is removed at once).",
    )

    folder_pin_max_bytes: Annotated[int, Field(ge=0, le=2**50)] | str = Field(
        default=f"{MAX_FOLDER_PIN_PERCENT}%",
        description="Budget of the pinned records of every process sharing the folder together (pin_max_bytes "
        "bounds each process's own): bytes or a percentage of max_bytes, at most "
        f"{MAX_FOLDER_PIN_PERCENT}% of it, so that a folder full of pins never refuses every store (0 or 0%: "
        "no pins in the folder). A pin "
        "past it is refused and counted as one past pin_max_bytes is (stats pins_refused). Each process "
        "counts the others' pinned bytes as they last wrote them (a record two processes pin counts twice; "
        "a round-27 engine's count as nothing: stats folder_pins_unknown_processes) (docs/operations.md).",
    )
    lock_wait_s: TimeoutSeconds = Field(
        default=5.0,
        description="Longest a write, removal or unpin waits for the folder's lock (every process of the folder "
        "takes it around its renames and evictions, for milliseconds) while another process holds it: one "
        "paused or hung holding it (SIGSTOP, a debugger, a frozen container). Then it gives up: the write is "
        "dropped (counted: errors, lock_timeouts), a removal fails, and the error names the folder and, "
        "where Linux says, the process.",
    )
    open_lock_wait_s: TimeoutSeconds = Field(
        default=30.0,
        description="Longest opening the tier waits for the folder's lock (its start-up listing runs under it; "
        "another process's listing of a large folder holds it seconds): then the open fails with an error "
        "that names the folder and, where Linux says, the process holding the lock.",
    )

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, path: Path) -> Path:
        return path.expanduser().absolute()

    @field_validator("folder_pin_max_bytes", mode="before")
    @classmethod
    def _folder_pin_share(cls, value: Any) -> int | str:
        share = parse_share("folder_pin_max_bytes", value)
        bound_share("folder_pin_max_bytes", share, None, at_most_percent=MAX_FOLDER_PIN_PERCENT, rest=_UNPINNED)
        return share

    @model_validator(mode="after")
    def _folder_pins_within_budget(self) -> DiskTierConfig:
        share, budget = self.folder_pin_max_bytes, int(self.max_bytes)
        bound_share("folder_pin_max_bytes", share, budget, at_most_percent=MAX_FOLDER_PIN_PERCENT, rest=_UNPINNED)
        return self

    def folder_pin_budget(self) -> int:
        """Pinned bytes every process sharing the folder may hold together."""
        share = self.folder_pin_max_bytes
        return share if isinstance(share, int) else int(int(self.max_bytes) * float(share[:-1]) / 100)


#: Where tier ``shm`` keeps its records unless told otherwise: tmpfs on every Linux host.
DEFAULT_SHM_PATH = Path("/dev/shm/kvplug")


class ShmTierConfig(DiskTierConfig):
    """Options of tier ``shm``: a disk tier's folder in shared memory, read by mapping."""

    path: Path = Field(
        default=DEFAULT_SHM_PATH,
        description="Folder of the cache on tmpfs (or ramfs), created 0700 if missing; every process of this "
        "user on the host that names it shares it. Elsewhere the tier warns once at start and still works. "
        "A tmpfs mounted with huge=always (2 MiB pages) reads several times faster than one of 4 KiB pages.",
    )
    fsync: Literal[False] = Field(
        default=False,
        description="Always off: tmpfs has nothing to sync to (a record is still written to a temp file and "
        "renamed into place, so a killed writer never leaves a torn record).",
    )
    write_threads: ThreadCount = Field(
        default=1,
        description="Records of one put written at once (1: one at a time; with no fdatasync to wait for, "
        "more threads only help on hosts with idle cores).",
    )
    keep_mapped_bytes: ByteSize | None = Field(
        default=None,
        description="Bytes of record mappings each process keeps after reading them, the least recently read "
        "let go first (None: max_bytes; 0: map every read anew). A record read again from a kept mapping "
        "costs no page faults, at memory speed, and its checksum is not computed again. Keeping costs "
        "page-table entries (8 bytes per 4 KiB page), and a record another process evicts stays in memory "
        "until this process lets its mapping go, within about a second while it reads the tier.",
    )
    trust_host: bool = Field(
        default=False,
        description="Trust the folder's bytes as this user's own memory: a read checks each record's header, "
        "key and length, not the checksum over its value (one pass over every loaded byte less; an "
        "integrity_key's MAC is still checked). Only for a folder that nothing but this user's kvplug "
        "engines writes: see docs/security.md.",
    )
