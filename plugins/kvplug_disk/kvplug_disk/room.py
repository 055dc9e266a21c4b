"""Room on a full tmpfs: what the file system says is free, and when evicting is in vain.

Tier ``shm`` evicts when its tmpfs is full (ENOSPC) before ``max_bytes`` binds. An
unlinked file's pages are freed only when its last mapping goes, and records are read by
mapping them: a record some process still maps (a view a caller holds, another process's
kept mapping, :mod:`kvplug_disk.mappings`) gives no memory back when it is evicted. So an
eviction counts only by what ``statvfs`` says came back (:class:`Room`), and once one
freed nothing, :class:`InVain` holds further evictions off until memory comes back (or
``IN_VAIN_HOLD_OFF_S`` passes): otherwise each write that finds the tmpfs full would
evict another record for nothing.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace

from kvplug_disk.mappings import SWEEP_INTERVAL_S

#: After an eviction on a full tmpfs freed nothing, how long writes that find it full are
#: dropped without evicting, unless memory comes back meanwhile: about the time other
#: processes' sweeps take to let go of their kept mappings of evicted records.
IN_VAIN_HOLD_OFF_S = 2 * SWEEP_INTERVAL_S


@dataclass(frozen=True)
class Room:
    """What a file system says is free for this user (``statvfs``): bytes, files, block size."""

    free: int
    files: int
    block: int

    @classmethod
    def of(cls, fd: int) -> Room | None:
        """The room of the file system holding the open folder ``fd``; ``None`` when it cannot be read."""
        try:
            found = os.fstatvfs(fd)
        except OSError:
            return None
        # No limit on files (tmpfs without nr_inodes says 0 of 0): only bytes can run out.
        files = found.f_favail if found.f_files else 1 << 62
        return cls(found.f_bavail * found.f_frsize, files, max(found.f_frsize, 1))

    def blocks(self, size: int) -> int:
        """Bytes of the whole blocks a file of ``size`` bytes takes."""
        return -(-size // self.block) * self.block

    def fits(self, size: int) -> bool:
        """Whether a new file of ``size`` bytes fits."""
        return self.free >= self.blocks(size) and self.files >= 1

    def more_than(self, before: Room) -> bool:
        """Whether something was freed since ``before``."""
        return self.free > before.free or self.files > before.files

    def less(self, size: int) -> Room:
        """This room less a file of ``size`` bytes."""
        return replace(self, free=self.free - self.blocks(size), files=self.files - 1)


class InVain:
    """Whether evicting on a full tmpfs is held off: an eviction freed nothing lately, and
    nothing was freed since (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: When an eviction last freed nothing, and the room after it.
        self._since: tuple[float, Room] | None = None

    def held_off(self, room: Room) -> bool:
        """Whether a write that finds the file system as full as ``room`` must not evict."""
        with self._lock:
            if self._since is None:
                return False
            when, then = self._since
            if time.monotonic() - when < IN_VAIN_HOLD_OFF_S and not room.more_than(then):
                return True
            self._since = None
            return False

    def freed_nothing(self, room: Room) -> None:
        """An eviction left the file system as full as ``room``."""
        with self._lock:
            self._since = (time.monotonic(), room)

    def wrote(self, size: int) -> None:
        """This process wrote a file of ``size`` bytes: memory it took is not memory that stayed held."""
        with self._lock:
            if self._since is not None:
                when, then = self._since
                self._since = (when, then.less(size))
