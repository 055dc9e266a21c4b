"""The folder-wide byte total of tier ``disk``, shared by every process using the folder.

Each process knows the records it found at start, wrote or read since; a budget kept
over those alone let two processes with ``max_bytes: 8MiB`` fill one folder to 16 MB.
So the value bytes of every record in the folder live in one small file,
``<folder>/.kvplug-usage`` (8 bytes, little-endian), read and changed only under an
exclusive ``flock`` on it. A process holds that lock from the moment it decides what
to evict until its new record is renamed into place, so the budget holds for the
folder as a whole; only writes in flight (temp files, at most one per writer) are
not counted.

The total is rebuilt from a scan of the folder at start and whenever
evicting all a process knows of would not bring the total within the budget: a process
killed between its rename and its update, or ``kvplug store gc`` run beside the
tiers, costs at most that drift until then; and at the next write when the file holds
no valid total (removed and made again: a process finding the file at the name is not the
one it locked moves to the new one). Where the folder cannot hold the file (a
read-only folder), cannot lock it, or holds something else under its name (a FIFO: never
waited on), the total is this process's own. Opened
``read_only`` (for inspection) the file is read if it is there, never created, locked
or written.

No wait for the lock is unbounded: a process paused while it holds it (SIGSTOP, a
debugger, a frozen container) would otherwise stop every process of the folder.
:meth:`UsageLedger.locked` tries the lock at once, then again after a growing pause
(0.5 ms doubling to 20 ms: TP ranks of one engine take it at every write), and raises
:class:`FolderLockTimeoutError` at its deadline: the caller's to choose (the tier's
``lock_wait_s`` for writes, ``open_lock_wait_s`` for the open's listing).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from kvplug.errors import TierUnavailableError
from kvplug_disk.files import PRIVATE_FILE
from kvplug_disk.tenant_tags import MAX_USAGE_BYTES, decode_usage, encode_usage

LEDGER_NAME = ".kvplug-usage"
#: The first pause of a wait for the folder's lock; each next one doubles, up to ``_LOCK_POLL_MAX_S``.
_LOCK_POLL_FIRST_S = 0.0005
_LOCK_POLL_MAX_S = 0.02
#: Where Linux lists the locks held on files (to name the process holding the folder's).
PROC_LOCKS = "/proc/locks"
#: Longest ``close`` waits for a call holding the lock to finish (each is bounded by its own wait).
_CLOSE_WAIT_S = 60.0
# Non-blocking: opening a FIFO planted under the ledger's name must not wait for a writer.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

logger = logging.getLogger("kvplug.tier.disk")


class FolderLockTimeoutError(BlockingIOError, TierUnavailableError):
    """The folder's lock stayed held past a bounded wait (by a process paused or hung while it
    holds it): what waited gave up, and changed nothing in the folder. A ``TierUnavailableError``
    too, so that ``kvplug store gc`` says it as an error, not a traceback."""

    def __init__(self, where: str, waited_s: float, then: str, holder: int | None) -> None:
        if holder is None:
            by = "another process or thread"
        elif holder == os.getpid():
            by = f"this process (pid {holder}: another of its threads or open files)"
        else:
            by = f"process {holder}"
        #: The process that held the lock, where ``/proc/locks`` named it.
        self.holder = holder
        super().__init__(
            errno.EWOULDBLOCK,
            f"{where}: {by} held the folder's lock ({LEDGER_NAME}) for over {waited_s:.1f} s "
            f"(paused or hung while holding it?): {then}",
        )


class Usage:
    """The total while the ledger is locked; ``save`` writes it before the lock is released."""

    def __init__(self, ledger: UsageLedger, total: int | None, tenants: dict[bytes, int] | None = None) -> None:
        self._ledger = ledger
        #: ``None`` when the file held no valid total: the caller rebuilds it from a scan.
        self.known = total is not None
        self.total = total or 0
        #: File bytes per tenant tag (:mod:`kvplug_disk.tenant_tags`); ``None`` when the file
        #: holds no valid table: a tier with quotas rebuilds it from a scan, the others keep none.
        self.tenants = tenants if self.known else None
        #: What the file holds (``None``: no valid total): compared on exit, not the total at entry,
        #: so that a change saved and then undone (a failed rename) is saved back.
        self.saved = total
        self._saved_tenants = _copied(self.tenants)

    @property
    def changed(self) -> bool:
        return self.total != self.saved or self.tenants != self._saved_tenants

    def add_tenant(self, tag: bytes | None, size: int) -> None:
        """Count ``size`` file bytes (negative: taken off) for tenant ``tag``, where the table is known."""
        if tag is None or self.tenants is None:
            return
        held = self.tenants.get(tag, 0) + size
        if held > 0:
            self.tenants[tag] = held
        else:
            self.tenants.pop(tag, None)

    def save(self) -> None:
        """Write the total, if it is known: a change to a total the file did not hold (a
        ledger made again) would be wrong; the next write rebuilds it from a listing."""
        if not self.known:
            return
        self.total = max(0, self.total)
        self._ledger._write(self.total, self.tenants)
        self.saved = self.total
        self._saved_tenants = _copied(self.tenants)


class UsageLedger:
    """One folder's shared byte total (see the module docstring)."""

    def __init__(self, root_fd: int, *, where: str, read_only: bool = False) -> None:
        #: The folder, as errors name it.
        self.where = where
        self._thread_lock = threading.Lock()  # flock is per open file, not per thread
        # Held around every read, write and close of the file ``_fd`` names: stats read it without
        # the thread lock (never waiting on another process's hold), and must not read through a
        # number that close() (or a move to a replaced ledger) freed meanwhile, which the next
        # open anywhere in the process takes. Taken inside the thread lock, never around it.
        self._fd_lock = threading.Lock()
        self._closing = False  # set by close(): a wait for another process's hold gives up at once
        self._local = 0
        self._local_tenants: dict[bytes, int] | None = {}
        self._write_failed = False
        self._fd: int | None = None
        self._root_fd = root_fd
        #: (device, inode) of the file open as ``_fd``: is it still the one at the ledger's name?
        self._identity = (0, 0)
        self.read_only = read_only
        #: The thread inside :meth:`locked` (``None``: none), for :meth:`held_here`.
        self._holder: int | None = None
        #: Called inside :meth:`locked` as it ends, before the lock goes (what must be written
        #: under the folder's lock, and was put off until then: the backend's pin figure).
        self.before_release: Callable[[], None] | None = None
        if read_only:
            with contextlib.suppress(OSError):  # none (a store of another kvplug), or not a file: the listing's total
                self._fd = _regular(os.open(LEDGER_NAME, os.O_RDONLY | _OPEN_FLAGS, dir_fd=root_fd))
            return
        try:
            fd = self._open_shared()
        except OSError as exc:
            logger.warning("disk tier: no shared usage file (%s); the budget counts this process's records only", exc)
            return
        try:  # can this file system lock files? (held by another process: it can)
            with contextlib.suppress(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fd, fcntl.LOCK_UN)
        except OSError as exc:
            os.close(fd)
            logger.warning(
                "disk tier: cannot lock the usage file (%s); the budget counts this process's records only", exc
            )
            return
        self._fd = fd
        self._identity = _identity(os.fstat(fd))

    def _open_shared(self) -> int:
        """The file at the ledger's name, opened to read and write (made if none)."""
        return _regular(os.open(LEDGER_NAME, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, PRIVATE_FILE, dir_fd=self._root_fd))

    @property
    def shared(self) -> bool:
        return self._fd is not None

    @contextmanager
    def locked(self, *, timeout_s: float, then: str) -> Iterator[Usage]:
        """Hold the folder's lock; the yielded total is saved on exit when changed. Raise
        :class:`FolderLockTimeoutError` (saying ``then``: what comes of giving up) when another thread
        or process holds it ``timeout_s`` seconds: a paused process may hold it for ever."""
        started = time.monotonic()
        if not self._thread_lock.acquire(timeout=timeout_s):
            raise self._timed_out(timeout_s, then)
        try:
            if self._fd is not None and not self.read_only:
                self._flock(started, timeout_s, then)
            self._holder = threading.get_ident()
            try:
                usage = Usage(self, *self._read())
                yield usage
                if usage.changed:
                    usage.save()
            finally:
                try:
                    if self.before_release is not None:
                        self.before_release()
                finally:
                    self._holder = None
                    if self._fd is not None and not self.read_only:
                        fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    def held_here(self) -> bool:
        """Whether the calling thread is inside :meth:`locked` (holds the folder's lock, where
        the folder can be locked at all)."""
        return self._holder == threading.get_ident()

    def _flock(self, started: float, timeout_s: float, then: str) -> None:
        assert self._fd is not None  # (close() waits for the thread lock this caller holds)
        pause = _LOCK_POLL_FIRST_S
        while True:  # flock has no timeout: try, and try again until the deadline
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                waited = time.monotonic() - started
                left = timeout_s - waited
                if left <= 0 or self._closing:
                    raise self._timed_out(waited, then) from None
                time.sleep(min(pause, left))
                pause = min(pause * 2, _LOCK_POLL_MAX_S)
                continue
            if self._locked_the_named_file():
                return
            pause = _LOCK_POLL_FIRST_S  # the file now at the ledger's name, at once

    def _locked_the_named_file(self) -> bool:
        """With ``_fd`` locked: whether it is the file at the ledger's name. A ledger removed or
        replaced since it was opened (a cleanup that removed it; the tier outlives its records going)
        would be locked by this process alone, while processes started since lock the new one:
        then ``_fd`` becomes the file there now (made if none; its total rebuilt by the next
        write) and ``False`` says to lock that. Where it cannot be opened, ``True``: the old
        file it is (this process's total, as where the folder holds no ledger)."""
        assert self._fd is not None
        with contextlib.suppress(OSError):
            if _identity(os.stat(LEDGER_NAME, dir_fd=self._root_fd, follow_symlinks=False)) == self._identity:
                return True
        try:
            fd = self._open_shared()
        except OSError:
            return True
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        with self._fd_lock:
            os.close(self._fd)
            self._fd, self._identity = fd, _identity(os.fstat(fd))
        logger.warning("disk tier: %s: its usage file was removed or replaced; using the one there now", self.where)
        return False

    def _timed_out(self, waited_s: float, then: str) -> FolderLockTimeoutError:
        holder = None if self._fd is None else lock_holder(self._fd)
        return FolderLockTimeoutError(self.where, waited_s, then, holder)

    def peek(self) -> int:
        """The total without locking (for stats)."""
        return self._read()[0] or 0

    def peek_tenants(self) -> dict[bytes, int] | None:
        """The file bytes of each tenant tag without locking (for stats); ``None``: no valid table."""
        return self._read()[1]

    def close(self) -> None:
        """Close the file, once a call holding or waiting for the lock has ended (a wait for
        another process's hold gives up at once): never under it, whose descriptor number
        another open could take meanwhile."""
        self._closing = True
        held = self._thread_lock.acquire(timeout=_CLOSE_WAIT_S)
        try:
            with self._fd_lock:
                fd, self._fd = self._fd, None
                if fd is not None:
                    os.close(fd)
        finally:
            if held:
                self._thread_lock.release()

    def _read(self) -> tuple[int | None, dict[bytes, int] | None]:
        """The folder's total and tenant table: the file's, ``None`` when it holds none (never
        written: a full disk refused its first 8 bytes), then rebuilt from a listing. Never this
        process's own copy while the file is shared: another process may have written it since."""
        with self._fd_lock:  # the descriptor read once, and not closed under the reads
            fd = self._fd
            if fd is None:
                return self._local, _copied(self._local_tenants)
            size = os.fstat(fd).st_size
            # Bounded: a file longer than any table (made sparse by a hand) must not be read whole.
            data = os.pread(fd, max(8, size) if size <= MAX_USAGE_BYTES else 8, 0)
        return decode_usage(data)

    def _write(self, total: int, tenants: dict[bytes, int] | None = None) -> None:
        self._local = total
        self._local_tenants = _copied(tenants)
        if self._fd is None or self.read_only:
            return
        data = encode_usage(total, tenants)
        try:
            with self._fd_lock:
                if self._fd is None:  # closed by a close() that gave up waiting for this call
                    return
                os.pwrite(self._fd, data, 0)
                os.ftruncate(self._fd, len(data))  # a table that shrank, or none now
        except OSError as exc:  # a full disk may refuse even 8 bytes for a new file
            if not self._write_failed:
                logger.warning("disk tier: cannot update the shared usage file (%s); retrying with each write", exc)
            self._write_failed = True
        else:
            self._write_failed = False


def _copied(tenants: dict[bytes, int] | None) -> dict[bytes, int] | None:
    return None if tenants is None else dict(tenants)


def _identity(info: os.stat_result) -> tuple[int, int]:
    return (info.st_dev, info.st_ino)


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


def lock_holder(fd: int, locks: str = PROC_LOCKS) -> int | None:
    """The process holding an ``flock`` on the file open as ``fd``, as ``locks`` lists it
    (``None`` where it does not: not Linux, a holder in another PID namespace, a file system
    whose inode it names otherwise). Read only when a wait gave up: it lists every lock of the host."""
    try:
        info = os.fstat(fd)
        inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
        with open(locks, encoding="ascii", errors="replace") as lines:
            for line in lines:
                fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 1234 fe:00:2236441 0 EOF"; waiters have "->"
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode:
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None
