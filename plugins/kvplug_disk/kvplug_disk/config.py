"""Options of tier ``disk``.

Why the tier owns its writer (``writer: background``) instead of relying on the
tier chain's ``write_mode: async``: the disk tier can do things a generic queue in
front of it cannot. It serves ``get``/``contains`` for values still in its queue
from memory (so a store is readable at once), coalesces repeated writes of one key,
cancels queued writes on ``remove``, and decides on ``close`` whether to write or
drop what is queued (``on_close``). So ``write_mode`` stays ``sync`` and every write
is queued exactly once; ``write_mode: async`` is accepted only with
``writer: inline`` (then the chain's queue is the only one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import ByteSize, Field, field_validator, model_validator

from kvplug import Bounded, QueueItems, ThreadCount, TierConfig, TimeoutSeconds


class DiskTierConfig(TierConfig):
    """Options of tier ``disk``; ``path`` is required."""

    path: Path = Field(description="Folder of the cache, created if missing. Several processes may share it.")
    max_bytes: ByteSize = Field(
        default=ByteSize(16 * 1024**3),
        description="Byte budget of stored values (each file also holds a 64-byte record header).",
    )
    fsync: bool = Field(
        default=True,
        description="fdatasync each file before it is renamed into place, and the folder after. "
        "Off: a power loss (not a process crash) may lose recent writes; never tears one.",
    )
    writer: Literal["background", "inline"] = Field(
        default="background",
        description="background: put queues the write for the tier's own writer thread; "
        "inline: put writes before it returns.",
    )
    write_threads: ThreadCount = Field(
        default=4,
        description="Records of one put written at once, so that their fdatasyncs overlap (each record is "
        "still renamed into place in the order it was put, after its own write). "
        "1: one at a time.",
    )
    queue_items: QueueItems = Field(default=64, description="Bound of the background writer's queue, in put batches.")
    queue_bytes: ByteSize = Field(
        default=ByteSize(256 * 1024**2),
        gt=0,
        description="Bound of the background writer's queue in bytes of values (queued and being written): "
        "queued values are held in memory until written.",
    )
    block_timeout_s: TimeoutSeconds = Field(
        default=30.0, description="With on_queue_full: block, a put waits this long for room, then drops."
    )
    on_close: Literal["flush", "drop"] = Field(
        default="flush", description="What close does with queued writes: write them, or drop them."
    )
    stale_temp_s: Annotated[float, Bounded(0, 7 * 86400, "seconds", exclusive_minimum=True, note="a week")] = Field(
        default=600.0,
        description="A temporary file this old is a leftover of a killed writer and is removed at start "
        "(one whose writer process on this host is gone is removed at once).",
    )

    @field_validator("path")
    @classmethod
    def _absolute_path(cls, path: Path) -> Path:
        return path.expanduser().absolute()

    @model_validator(mode="after")
    def _one_queue(self) -> DiskTierConfig:
        if self.write_mode == "async" and self.writer == "background":
            raise ValueError(
                "write_mode: async with writer: background would queue every write twice; "
                "keep write_mode: sync (the default), or set writer: inline"
            )
        return self
