"""The folder-wide byte total of tier ``disk``, shared by every process using the folder.

Each process knows the records it found at start, wrote or read since; a budget kept
over those alone let two processes with ``max_bytes: 8MiB`` fill one folder to 16 MB.
So the value bytes of every record in the folder live in one small file,
``<folder>/.kvplug-usage`` (8 bytes, little-endian), read and changed only under an
exclusive ``flock`` on it. A process holds that lock from the moment it decides what
to evict until its new record is renamed into place, so the budget holds for the
folder as a whole; only writes in flight (temp files, at most one per writer) are
not counted.

The total is rebuilt from a scan of the folder at start and whenever a process has
nothing left of its own to evict while the total says the folder is full: a process
killed between its rename and its update, or ``kvplug store gc`` run beside the
tiers, costs at most that drift until then. Where the folder cannot hold the file (a
read-only folder), cannot lock it, or holds something else under its name (a FIFO: never
waited on), the total is this process's own. Opened
``read_only`` (for inspection) the file is read if it is there, never created, locked
or written.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from kvplug_disk.files import PRIVATE_FILE

LEDGER_NAME = ".kvplug-usage"
#: How often a bounded wait for the folder's lock tries it again.
_LOCK_POLL_S = 0.005

logger = logging.getLogger("kvplug.tier.disk")


class Usage:
    """The total while the ledger is locked; ``save`` writes it before the lock is released."""

    def __init__(self, ledger: UsageLedger, total: int | None) -> None:
        self._ledger = ledger
        #: ``None`` when the file held no valid total: the caller rebuilds it from a scan.
        self.known = total is not None
        self.total = total or 0

    def save(self) -> None:
        self.total = max(0, self.total)
        self.known = True
        self._ledger._write(self.total)


class UsageLedger:
    """One folder's shared byte total (see the module docstring)."""

    def __init__(self, root_fd: int, *, read_only: bool = False) -> None:
        self._thread_lock = threading.Lock()  # flock is per open file, not per thread
        self._local = 0
        self._write_failed = False
        self._fd: int | None = None
        self.read_only = read_only
        # Non-blocking: opening a FIFO planted under the ledger's name must not wait for a writer.
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        if read_only:
            try:
                self._fd = _regular(os.open(LEDGER_NAME, os.O_RDONLY | flags, dir_fd=root_fd))
            except OSError:  # none (a store of another kvplug), or not a file: the total is the listing's
                pass
            return
        try:
            fd = _regular(os.open(LEDGER_NAME, os.O_RDWR | os.O_CREAT | flags, PRIVATE_FILE, dir_fd=root_fd))
        except OSError as exc:
            logger.warning("disk tier: no shared usage file (%s); the budget counts this process's records only", exc)
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            os.close(fd)
            logger.warning(
                "disk tier: cannot lock the usage file (%s); the budget counts this process's records only", exc
            )
            return
        self._fd = fd

    @property
    def shared(self) -> bool:
        return self._fd is not None

    @contextmanager
    def locked(self, *, timeout_s: float | None = None) -> Iterator[Usage]:
        """Hold the folder's lock; the yielded total is saved on exit when changed. With
        ``timeout_s``, raise ``BlockingIOError`` when another thread or process holds it that
        long (a paused process may hold it for ever: a read must not wait on it)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._thread_lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise BlockingIOError(errno.EWOULDBLOCK, "another thread holds the folder's lock")
        try:
            if self._fd is not None and not self.read_only:
                self._flock(deadline)
            try:
                usage = Usage(self, self._read())
                before = usage.total if usage.known else None
                yield usage
                if usage.total != before:
                    usage.save()
            finally:
                if self._fd is not None and not self.read_only:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def _flock(self, deadline: float | None) -> None:
        assert self._fd is not None
        if deadline is None:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            return
        while True:  # flock has no timeout: try, and try again until the deadline
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise BlockingIOError(errno.EWOULDBLOCK, "another process holds the folder's lock") from None
                time.sleep(_LOCK_POLL_S)

    def peek(self) -> int:
        """The total without locking (for stats)."""
        return self._read() or 0

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def _read(self) -> int | None:
        if self._fd is None or self._write_failed:
            return self._local
        data = os.pread(self._fd, 8, 0)
        return int.from_bytes(data, "little") if len(data) == 8 else None

    def _write(self, total: int) -> None:
        self._local = total
        if self._fd is None or self.read_only:
            return
        try:
            os.pwrite(self._fd, total.to_bytes(8, "little"), 0)
        except OSError as exc:  # a full disk may refuse even 8 bytes for a new file
            if not self._write_failed:
                logger.warning("disk tier: cannot update the shared usage file (%s); retrying with each write", exc)
            self._write_failed = True
        else:
            self._write_failed = False


def _regular(fd: int) -> int:
    """``fd`` if it is a regular file; else it is closed and ``OSError`` names what is there."""
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind != stat.S_IFREG:
            what = {stat.S_IFIFO: "a FIFO", stat.S_IFDIR: "a folder", stat.S_IFSOCK: "a socket"}.get(kind, "a device")
            raise OSError(errno.EINVAL, f"{LEDGER_NAME} in the folder is {what}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd
