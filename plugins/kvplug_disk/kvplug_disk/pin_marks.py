"""Pins that hold for every process sharing a folder: a mark on the pinned record file itself.

A pin lives in the engine that asked for it (:class:`kvplug.PinBook`), but a folder's budget and
quotas are kept by every process that shares it, each evicting the records its own order knows
of, and a listing (at open, or when what a process knows of cannot make room) makes it know
every record in the folder. So a record that a process pins carries a **pin mark**: an
extended attribute ``user.kvplug.pin.<owner>`` that the process sets when it pins the record
(or stores one its pin book wants pinned) and removes when it unpins it. Any process about to
evict a record reads its marks first and leaves it in place while one of them names a live
owner other than itself (:meth:`PinMarks.held_elsewhere`).

- **Owners, and pins of a process that died** (their lock files: :mod:`kvplug_disk.pin_owners`). ``<owner>`` is a random 128-bit id, one per open
  tier. The owner holds an exclusive ``flock`` on ``.kvplug-pins/<owner>`` in the folder for as
  long as the tier is open, and the kernel drops it when the process ends, however it ends
  (SIGKILL too). A mark whose owner file is gone or not locked is dead: ignored, removed from
  the record where seen, and the owner file with it (and at each writable open of the folder,
  :meth:`PinMarks.sweep`, the files of every owner gone). So a pin never outlives every process
  that wanted it. The owner file is locked before it gets its name (a temp name, renamed), so no
  process ever sees the file of a live owner unlocked. A temp one that a crash left (``<owner>.tmp``,
  unlocked) is swept too: owners make theirs, and sweeps run, under the folder's lock, so a sweep
  never meets one being made. A child forked by the owner's process
  shares the lock: its pins hold while either lives (until the owner closes the tier: :meth:`PinMarks.close`
  removes the lock file).
- **Stored again.** A record stored again is a new file renamed over the old one: the write
  copies the old file's live marks onto the new one first, under the folder's lock that every
  eviction takes too (:meth:`PinMarks.carry_over`), so another engine's store of a pinned chunk
  does not drop its pin.
- **Without user extended attributes** (tmpfs before Linux 6.6, some network file systems) no
  mark can be set (``pin_marks_failed``): pins are then per process, as before, each engine
  never evicting what it pinned, another one possibly.

- **How much is pinned.** The owner writes its pinned bytes into its lock file whenever they
  change (:meth:`PinMarks.publish`), so the folder's pins are summed over its live owners
  without reading any record's marks (:meth:`PinMarks.figures`; the sum counts a record two
  owners pin twice), and bounded as a whole (the tier's ``folder_pin_max_bytes``).

Marks are sets of attributes, one per owner, not one list: owners add and remove their own
without reading and rewriting anyone else's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
from typing import Protocol

from kvplug_disk.folder_scan import RECORD_SUFFIX
from kvplug_disk.pin_owners import (
    OPEN_FLAGS,
    OWNERS_FOLDER,
    PinFigures,
    folder_pin_figures,
    is_owner_id,
    make_owner_file,
    owner_alive,
    remove_owner_file,
    sweep_owners,
    write_pinned,
)

#: A pin mark's attribute: this prefix and its owner's id.
MARK_PREFIX = "user.kvplug.pin."
_MARK_VALUE = b"1"


class Records(Protocol):
    """What :class:`PinMarks` needs of a :class:`~kvplug_disk.files.RecordFolder`."""

    def open_record(self, digest: str) -> tuple[int, os.stat_result] | None: ...


class PinMarks:
    """The pin marks of one open tier (its owner id) in the folder open as ``root_fd``
    (see the module docstring). Thread-safe; every call is best effort: a file operation
    that fails is counted, never raised."""

    def __init__(
        self,
        root_fd: int,
        records: Records,
        *,
        read_only: bool = False,
        logger: logging.Logger | None = None,
        where: str = "the folder",
    ) -> None:
        self._root_fd = root_fd
        self._logger = logger or logging.getLogger(__name__)
        self._where = where
        self._warned = False
        self._records = records
        self.read_only = read_only
        self.owner = secrets.token_hex(16)
        self._attr = MARK_PREFIX + self.owner
        self._owner_fd: int | None = None
        self._published: int | None = 0  # the pinned bytes in the lock file (made with 0; None: unsure)
        self._lock = threading.Lock()
        #: The records this owner marked (and has not unmarked since).
        self.marked: set[str] = set()
        self.counts = {"pin_marks_failed": 0, "dead_pin_marks_removed": 0}

    # --- this owner's marks -----------------------------------------------------------

    def mark(self, digest: str) -> bool:
        """Mark the record ``digest`` pinned by this owner; whether it is (and still in the folder)."""
        if not self._claim():
            return False
        opened = self._open(digest)
        if opened is None:
            return False
        try:
            self._live_owners(opened)  # drops dead marks: each restart is a new owner, they must not pile up
            os.setxattr(opened, self._attr, _MARK_VALUE)
            linked = os.fstat(opened).st_nlink > 0  # not unlinked before the mark was set
        except OSError as exc:  # no user attributes here, or no room for one more
            self._failed(f"cannot set the pin mark {self._attr} on a record", exc)
            return False
        finally:
            os.close(opened)
        if linked:
            with self._lock:
                self.marked.add(digest)
        return linked

    def forget(self, digest: str) -> None:
        """The record ``digest`` left the folder, and this owner's mark with it."""
        with self._lock:
            self.marked.discard(digest)

    def unmark(self, digests: set[str] | list[str]) -> None:
        """Remove this owner's marks from the records ``digests`` (those it marked)."""
        with self._lock:
            mine = [digest for digest in digests if digest in self.marked]
            self.marked.difference_update(mine)
        for digest in mine:
            opened = self._open(digest)
            if opened is None:
                continue
            try:
                with contextlib.suppress(OSError):  # gone already (the file was stored again without it)
                    os.removexattr(opened, self._attr)
            finally:
                os.close(opened)

    def publish(self, pinned: int, *, make: bool = True) -> None:
        """Write this owner's ``pinned`` bytes into its lock file, where other owners and
        ``kvplug store stats`` sum them (made when first needed, unless not ``make``: none for
        nothing pinned)."""
        with self._lock:
            if pinned == self._published or (self._owner_fd is None and not (pinned and make)):
                return
        if not self._claim():
            return
        with self._lock:
            if self._owner_fd is None:  # closed meanwhile
                return
            try:
                write_pinned(self._owner_fd, pinned)
            except OSError:  # (a full disk: the last figure stands, the next call tries again)
                self._published = None
                return
            self._published = pinned

    def figures(self, *, others_only: bool = False) -> PinFigures:
        """The folder's pins, summed over its live owners (this one by its last :meth:`publish`;
        ``others_only``: without it)."""
        return folder_pin_figures(self._root_fd, skip=self.owner if others_only else None)

    # --- everyone's marks ---------------------------------------------------------------

    def held_elsewhere(self, digest: str) -> list[str]:
        """The live owners other than this one that marked the record ``digest`` pinned (the
        folder's lock held: call before evicting it). Dead owners' marks are removed."""
        return [owner for owner in self._marked_by(digest) if owner != self.owner]

    def alive(self, owner: str) -> bool:
        """Whether the owner ``owner`` (of a mark :meth:`held_elsewhere` named) still holds its
        lock file; one that does not is dead for good, its lock file removed."""
        return owner_alive(self._root_fd, owner)

    def carry_over(self, digest: str, temp_name: str, temp_dir_fd: int) -> None:
        """Copy the live marks, this owner's too, from the record ``digest`` to the temp file
        about to be renamed over it (the folder's lock held)."""
        owners = self._marked_by(digest)
        if not owners:
            return
        try:
            temp = os.open(temp_name, OPEN_FLAGS, dir_fd=temp_dir_fd)
            try:
                for owner in owners:
                    os.setxattr(temp, MARK_PREFIX + owner, _MARK_VALUE)
            finally:
                os.close(temp)
        except OSError as exc:
            self._failed("cannot copy the pin marks onto a record stored again", exc)

    def sweep(self) -> int:
        """Remove the lock files of owners that are gone (at a tier's open, the folder's lock
        held): :func:`~kvplug_disk.pin_owners.sweep_owners`. How many."""
        return sweep_owners(self._root_fd)

    def close(self) -> None:
        """Give up this owner's marks: its lock file goes (the marks left on records are dead)."""
        with self._lock:
            fd, self._owner_fd = self._owner_fd, None
            self.marked.clear()
            self._published = 0
        if fd is None:
            return
        remove_owner_file(self._root_fd, self.owner)
        os.close(fd)

    # --- helpers ----------------------------------------------------------------------

    def _claim(self) -> bool:
        """Hold this owner's lock file (made once); whether it is held (never for inspection)."""
        with self._lock:
            if self._owner_fd is not None:
                return True
            if self.read_only:
                return False
            try:
                self._owner_fd = make_owner_file(self._root_fd, self.owner)
                return True
            except OSError as exc:
                failed = exc
        self._failed(f"cannot make the pin lock file {OWNERS_FOLDER}/{self.owner}", failed)
        return False

    def _marked_by(self, digest: str) -> list[str]:
        """The live owners (this one too) that marked the record ``digest``; dead marks are removed."""
        if not self._has_marks(digest):  # (the common case: one call, no descriptor)
            return []
        opened = self._open(digest)
        if opened is None:
            return []
        try:
            return self._live_owners(opened)
        finally:
            os.close(opened)

    def _has_marks(self, digest: str) -> bool:
        """Whether the record file ``digest`` carries any pin mark: a cheaper look than
        :meth:`_open`'s (which checks the shard folder and the file's type) for the common
        case of a record no one pinned."""
        try:
            fd = os.open(f"{digest[:2]}/{digest}{RECORD_SUFFIX}", OPEN_FLAGS, dir_fd=self._root_fd)
        except OSError:  # no such file (or a link at its name: not a record)
            return False
        try:
            return any(name.startswith(MARK_PREFIX) for name in os.listxattr(fd))
        except OSError:  # no attributes here
            return False
        finally:
            os.close(fd)

    def _open(self, digest: str) -> int | None:
        try:
            opened = self._records.open_record(digest)
        except OSError:  # not a regular file: the tier's own checks say so
            return None
        return None if opened is None else opened[0]

    def _live_owners(self, fd: int) -> list[str]:
        """The owners of the live marks on the open record ``fd``; dead marks are removed."""
        try:
            names = [name for name in os.listxattr(fd) if name.startswith(MARK_PREFIX)]
        except OSError:
            return []
        live = []
        for name in names:
            owner = name[len(MARK_PREFIX) :]
            if owner == self.owner or (is_owner_id(owner) and self.alive(owner)):
                live.append(owner)
            else:
                self._remove_mark(fd, name)
        return live

    def _failed(self, what: str, exc: OSError) -> None:
        """Count a mark that could not be set; say why the first time (the count alone does
        not tell an operator whether the file system or the folder is at fault)."""
        with self._lock:
            self.counts["pin_marks_failed"] += 1
            first, self._warned = not self._warned, True
        if first:
            self._logger.warning(
                "disk tier: %s in %s: %s; pins hold in this process only (pin_marks_failed counts them)",
                what,
                self._where,
                exc,
            )

    def _remove_mark(self, fd: int, name: str) -> None:
        try:
            os.removexattr(fd, name)
        except OSError:
            return
        with self._lock:
            self.counts["dead_pin_marks_removed"] += 1
