"""Pins that hold for every process sharing a folder: a mark on the pinned record file itself.

A pin lives in the engine that asked for it (:class:`kvplug.PinBook`), but a folder's budget and
quotas are kept by every process that shares it, each evicting the records its own order knows
of, and a listing (at open, or when what a process knows of cannot make room) makes it know
every record in the folder. So a record that a process pins carries a **pin mark**: an
extended attribute ``user.kvplug.pin.<owner>`` that the process sets when it pins the record
(or stores one its pin book wants pinned) and removes when it unpins it. Any process about to
evict a record reads its marks first and leaves it in place while one of them names a live
owner other than itself (:meth:`PinMarks.held_elsewhere`).

- **Owners, and pins of a process that died.** ``<owner>`` is a random 128-bit id, one per open
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

Marks are sets of attributes, one per owner, not one list: owners add and remove their own
without reading and rewriting anyone else's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import threading
from typing import Protocol

from kvplug_disk.folder_scan import RECORD_SUFFIX

#: A pin mark's attribute: this prefix and its owner's id.
MARK_PREFIX = "user.kvplug.pin."
#: The folder (in the store's root) of the owners' lock files.
OWNERS_FOLDER = ".kvplug-pins"
_OWNER = re.compile(r"[0-9a-f]{32}")
#: An owner's lock file being made (:meth:`PinMarks._make_owner_file`), or left by a crash.
_OWNER_TEMP = re.compile(r"[0-9a-f]{32}\.tmp")
_MARK_VALUE = b"1"
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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

    # --- everyone's marks ---------------------------------------------------------------

    def held_elsewhere(self, digest: str) -> list[str]:
        """The live owners other than this one that marked the record ``digest`` pinned (the
        folder's lock held: call before evicting it). Dead owners' marks are removed."""
        return [owner for owner in self._marked_by(digest) if owner != self.owner]

    def alive(self, owner: str) -> bool:
        """Whether the owner ``owner`` (of a mark :meth:`held_elsewhere` named) still holds its
        lock file; one that does not is dead for good, its lock file removed (:meth:`_alive_in`)."""
        try:
            folder = self._open_owners_folder()
        except (FileNotFoundError, NotADirectoryError):  # no owners' folder: no owner holds a lock
            return False
        except OSError as exc:
            # A link in its place (ELOOP): owners make their files only in a real folder, so
            # none holds a lock through it. Anything else: cannot tell, keep its marks.
            return exc.errno != errno.ELOOP
        try:
            return self._alive_in(folder, owner)
        finally:
            os.close(folder)

    def carry_over(self, digest: str, temp_name: str, temp_dir_fd: int) -> None:
        """Copy the live marks, this owner's too, from the record ``digest`` to the temp file
        about to be renamed over it (the folder's lock held)."""
        owners = self._marked_by(digest)
        if not owners:
            return
        try:
            temp = os.open(temp_name, _OPEN_FLAGS, dir_fd=temp_dir_fd)
            try:
                for owner in owners:
                    os.setxattr(temp, MARK_PREFIX + owner, _MARK_VALUE)
            finally:
                os.close(temp)
        except OSError as exc:
            self._failed("cannot copy the pin marks onto a record stored again", exc)

    def sweep(self) -> int:
        """Remove the lock files of owners that are gone (at a tier's open): those whose marks no
        eviction came across, because their records were removed or are never evicted, and the
        temp ones of owners that crashed making theirs. How many."""
        try:
            folder = self._open_owners_folder()
        except OSError:  # none yet (no pin was ever marked here)
            return 0
        try:
            names = os.listdir(folder)
            owners = [name for name in names if _OWNER.fullmatch(name)]
            temps = [name for name in names if _OWNER_TEMP.fullmatch(name)]
            return sum(not self._alive_in(folder, owner) for owner in owners) + sum(
                self._sweep_temp(folder, temp) for temp in temps
            )
        except OSError:
            return 0
        finally:
            os.close(folder)

    def close(self) -> None:
        """Give up this owner's marks: its lock file goes (the marks left on records are dead)."""
        with self._lock:
            fd, self._owner_fd = self._owner_fd, None
            self.marked.clear()
        if fd is None:
            return
        try:
            folder = self._open_owners_folder()
            try:
                os.unlink(self.owner, dir_fd=folder)
            finally:
                os.close(folder)
        except OSError:
            pass
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
                self._owner_fd = self._make_owner_file()
                return True
            except OSError as exc:
                failed = exc
        self._failed(f"cannot make the pin lock file {OWNERS_FOLDER}/{self.owner}", failed)
        return False

    def _make_owner_file(self) -> int:
        with contextlib.suppress(FileExistsError):
            os.mkdir(OWNERS_FOLDER, 0o700, dir_fd=self._root_fd)
        folder = self._open_owners_folder()
        try:
            temp = f"{self.owner}.tmp"
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(temp, flags, 0o600, dir_fd=folder)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else holds it
                os.rename(temp, self.owner, src_dir_fd=folder, dst_dir_fd=folder)
            except BaseException:
                os.close(fd)
                os.unlink(temp, dir_fd=folder)
                raise
        finally:
            os.close(folder)
        return fd

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
            fd = os.open(f"{digest[:2]}/{digest}{RECORD_SUFFIX}", _OPEN_FLAGS, dir_fd=self._root_fd)
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
            if owner == self.owner or (_OWNER.fullmatch(owner) and self.alive(owner)):
                live.append(owner)
            else:
                self._remove_mark(fd, name)
        return live

    def _open_owners_folder(self) -> int:
        """The owners' folder, never through a link: one that is not a folder of the store's
        own (a link placed there) must not make this tier open or remove files elsewhere."""
        return os.open(OWNERS_FOLDER, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self._root_fd)

    def _alive_in(self, folder: int, owner: str) -> bool:
        """Whether ``owner`` holds its lock file in the owners' folder open as ``folder``. One
        that does not is dead for good (ids are never reused): its file is removed."""
        try:
            fd = os.open(owner, _OPEN_FLAGS, dir_fd=folder)
        except FileNotFoundError:
            return False
        except OSError as exc:
            if exc.errno != errno.ELOOP:  # cannot tell (not ours to open): keep its marks
                return True
            # A link: owners make regular files, so no owner holds it; its marks would keep
            # their records for good. The link goes (not what it leads to).
            self._unlink_quietly(owner, folder)
            return False
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:  # held by its owner (EWOULDBLOCK), or cannot tell: keep its marks
                return True
            self._unlink_quietly(owner, folder)
            return False
        finally:
            os.close(fd)

    def _sweep_temp(self, folder: int, temp: str) -> bool:
        """Remove the temp lock file ``temp`` if no owner holds it (a crash left it between its
        making and its rename: both run under the folder's lock, as this does); whether it was."""
        try:
            fd = os.open(temp, _OPEN_FLAGS, dir_fd=folder)
        except OSError:  # gone (renamed), or not a file an owner made: left alone
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its owner holds it: being made
            return False
        else:
            return self._unlink_quietly(temp, folder)
        finally:
            os.close(fd)

    @staticmethod
    def _unlink_quietly(name: str, folder: int) -> bool:
        try:
            os.unlink(name, dir_fd=folder)
        except OSError:  # gone already, or a folder: the sweep meets it again, harmless
            return False
        return True

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
