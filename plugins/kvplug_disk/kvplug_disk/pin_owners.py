"""The owners of pin marks (:mod:`kvplug_disk.pin_marks`): their lock files in ``.kvplug-pins``.

An owner (one open tier, a random 128-bit id) is alive while it holds an exclusive ``flock``
on ``.kvplug-pins/<owner>`` in the folder; the kernel drops it when the process ends, however
it ends. An owner whose file is gone or not locked is dead for good (ids are never reused): its
file is removed where seen. These functions hold no state: :class:`~kvplug_disk.pin_marks.PinMarks`
keeps its owner's id and lock file, and says under which locks each runs.

**Figures.** An owner's lock file holds one line, its pinned bytes (:func:`write_pinned`,
rewritten in place by its owner, which holds the file's lock), so anyone may sum a folder's pins
over its live owners (:func:`folder_pin_figures`) without a look at any record. The line is of
fixed width, so a rewrite covers the last one whole, and carries a CRC-32 of its number, so a
reader that meets a rewrite half-done reads again. A round-27 engine's lock file is empty: its
pins are unknown (counted apart, as nothing), and it reads nothing of a file that has a line
(its sweep and liveness checks only lock the file).

Nothing here is followed through a link: the owners' folder and the files in it are opened with
``O_NOFOLLOW``, so a link planted there never makes a tier open or remove files elsewhere.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import zlib
from dataclasses import dataclass

#: The folder (in the store's root) of the owners' lock files.
OWNERS_FOLDER = ".kvplug-pins"
_OWNER = re.compile(r"[0-9a-f]{32}")
#: An owner's lock file being made (:func:`make_owner_file`), or left by a crash.
_OWNER_TEMP = re.compile(r"[0-9a-f]{32}\.tmp")
#: Non-blocking: opening a FIFO planted under a file's name must not wait for a writer.
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
#: An owner's figure: its pinned bytes, and the CRC-32 of those 20 digits.
_FIGURE = re.compile(rb"pinned (\d{20}) ([0-9a-f]{8})\n")
_FIGURE_SIZE = 37
#: The largest figure believed (a PiB, past any folder a tier may be given): a file whose
#: checksum matches a larger one was not written by an engine, and would refuse every pin.
_FIGURE_MAX = 1 << 50
#: Reads of a figure that a rewrite tore before it counts as unknown.
_FIGURE_READS = 3


@dataclass(frozen=True)
class PinFigures:
    """A folder's pins summed over its live owners (:func:`folder_pin_figures`)."""

    #: Pinned bytes (record file bytes) that live owners say they hold; a record two owners
    #: pin counts twice.
    pinned_bytes: int = 0
    #: Live owners that pin some bytes.
    pinning: int = 0
    #: Live owners whose pins are unknown: a round-27 engine's empty file, or one unreadable.
    unknown: int = 0


def is_owner_id(name: str) -> bool:
    """Whether ``name`` is spelled like an owner's id (a mark naming anything else is no owner's)."""
    return _OWNER.fullmatch(name) is not None


def make_owner_file(root_fd: int, owner: str) -> int:
    """Make ``owner``'s lock file and hold its lock; its descriptor. Locked before it gets its
    name (a temp name, renamed), so no process ever sees the file of a live owner unlocked; run
    under the folder's lock, as :func:`sweep_owners` is, so a sweep never meets one being made."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(OWNERS_FOLDER, 0o700, dir_fd=root_fd)
    folder = _open_owners_folder(root_fd)
    try:
        temp = f"{owner}.tmp"
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(temp, flags, 0o600, dir_fd=folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a new file: no one else holds it
            # Seen with a figure from the start (an empty file reads as a round-27 engine's: its
            # pins unknown). Best effort: a full disk that has room for no block still gets the
            # lock file (its rewrites then try again), as before figures.
            with contextlib.suppress(OSError):
                write_pinned(fd, 0)
            os.rename(temp, owner, src_dir_fd=folder, dst_dir_fd=folder)
        except BaseException:
            os.close(fd)
            os.unlink(temp, dir_fd=folder)
            raise
    finally:
        os.close(folder)
    return fd


def write_pinned(fd: int, pinned: int) -> None:
    """Write an owner's pinned bytes into its lock file, open as ``fd`` (the owner's)."""
    digits = b"%020d" % pinned
    os.pwrite(fd, b"pinned %s %08x\n" % (digits, zlib.crc32(digits)), 0)


def folder_pin_figures(root_fd: int, skip: str | None = None) -> PinFigures:
    """The pins of the folder's live owners but ``skip``, summed from their lock files. Changes
    nothing (a dead owner's file is left to a sweep): ``kvplug store stats`` reads it too."""
    try:
        folder = _open_owners_folder(root_fd)
    except OSError:  # none yet (no pin was ever marked here), or not a folder of the store's own
        return PinFigures()
    pinned = pinning = unknown = 0
    try:
        for name in os.listdir(folder):
            if name == skip or not _OWNER.fullmatch(name):
                continue
            alive, figure = _figure_in(folder, name)
            if not alive:
                continue
            if figure is None:
                unknown += 1
            elif figure:
                pinned += figure
                pinning += 1
    except OSError:  # the folder could not be listed: what was read so far
        pass
    finally:
        os.close(folder)
    return PinFigures(pinned, pinning, unknown)


def remove_owner_file(root_fd: int, owner: str) -> None:
    """Remove ``owner``'s lock file (its owner closing), if it can."""
    with contextlib.suppress(OSError):
        folder = _open_owners_folder(root_fd)
        try:
            os.unlink(owner, dir_fd=folder)
        finally:
            os.close(folder)


def owner_alive(root_fd: int, owner: str) -> bool:
    """Whether ``owner`` holds its lock file; one that does not is dead for good, its file removed."""
    try:
        folder = _open_owners_folder(root_fd)
    except (FileNotFoundError, NotADirectoryError):  # no owners' folder: no owner holds a lock
        return False
    except OSError as exc:
        # A link in its place (ELOOP): owners make their files only in a real folder, so
        # none holds a lock through it. Anything else: cannot tell, keep its marks.
        return exc.errno != errno.ELOOP
    try:
        return _alive_in(folder, owner)
    finally:
        os.close(folder)


def sweep_owners(root_fd: int) -> int:
    """Remove the lock files of owners that are gone (at a tier's open): those whose marks no
    eviction came across, because their records were removed or are never evicted, and the
    temp ones of owners that crashed making theirs. How many."""
    try:
        folder = _open_owners_folder(root_fd)
    except OSError:  # none yet (no pin was ever marked here)
        return 0
    try:
        names = os.listdir(folder)
        owners = [name for name in names if _OWNER.fullmatch(name)]
        temps = [name for name in names if _OWNER_TEMP.fullmatch(name)]
        return sum(not _alive_in(folder, owner) for owner in owners) + sum(_sweep_temp(folder, temp) for temp in temps)
    except OSError:
        return 0
    finally:
        os.close(folder)


def _open_owners_folder(root_fd: int) -> int:
    """The owners' folder, never through a link: one that is not a folder of the store's
    own (a link placed there) must not make this tier open or remove files elsewhere."""
    return os.open(OWNERS_FOLDER, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=root_fd)


def _alive_in(folder: int, owner: str) -> bool:
    """Whether ``owner`` holds its lock file in the owners' folder open as ``folder``. One
    that does not is dead for good (ids are never reused): its file is removed."""
    try:
        fd = os.open(owner, OPEN_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if exc.errno != errno.ELOOP:  # cannot tell (not ours to open): keep its marks
            return True
        # A link: owners make regular files, so no owner holds it; its marks would keep
        # their records for good. The link goes (not what it leads to).
        _unlink_quietly(owner, folder)
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held by its owner (EWOULDBLOCK), or cannot tell: keep its marks
            return True
        _unlink_quietly(owner, folder)
        return False
    finally:
        os.close(fd)


def _figure_in(folder: int, owner: str) -> tuple[bool, int | None]:
    """Whether ``owner`` is alive, and its pinned bytes (``None``: unknown)."""
    try:
        fd = os.open(owner, OPEN_FLAGS, dir_fd=folder)
    except OSError as exc:  # gone or a link: no live owner; not ours to open: cannot tell
        return exc.errno not in (errno.ENOENT, errno.ELOOP), None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:  # held by its owner
            pass
        except OSError:
            return True, None
        else:
            return False, None  # dead (unlocked as it closes)
        for _ in range(_FIGURE_READS):
            line = os.pread(fd, _FIGURE_SIZE, 0)
            found = _FIGURE.fullmatch(line)
            if found is not None and b"%08x" % zlib.crc32(found.group(1)) == found.group(2):
                figure = int(found.group(1))
                return True, figure if figure <= _FIGURE_MAX else None
            if not line:  # a round-27 engine's (or an unknown owner's): nothing to wait for
                break
        return True, None
    except OSError:
        return True, None
    finally:
        os.close(fd)


def _sweep_temp(folder: int, temp: str) -> bool:
    """Remove the temp lock file ``temp`` if no owner holds it (a crash left it between its
    making and its rename: both run under the folder's lock, as this does); whether it was."""
    try:
        fd = os.open(temp, OPEN_FLAGS, dir_fd=folder)
    except OSError:  # gone (renamed), or not a file an owner made: left alone
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # its owner holds it: being made
        return False
    else:
        return _unlink_quietly(temp, folder)
    finally:
        os.close(fd)


def _unlink_quietly(name: str, folder: int) -> bool:
    try:
        os.unlink(name, dir_fd=folder)
    except OSError:  # gone already, or a folder: the sweep meets it again, harmless
        return False
    return True
