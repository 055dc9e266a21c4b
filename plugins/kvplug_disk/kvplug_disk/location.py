"""Which folders are kvplug disk stores: the marker a disk tier leaves, and the check
that ``kvplug store`` and ``kvplug explain`` make before they open one.

A disk store is a folder holding shard folders ``00``..``ff``. Opening a disk tier to
write creates them, so an inspection pointed at the wrong folder (a typo, a home
directory) would litter it, and clean "stale" ``*.tmp`` files that are not its own.
So a location is refused, before anything in it is opened, unless it is positively a
store (:func:`require_disk_store`):

- it holds the marker file ``.kvplug-store``, which every disk tier (and ``shm`` tier)
  writes into its folder when it opens it to write (:func:`mark_store`); or
- it is a store of a kvplug from before the marker: the usage ledger ``.kvplug-usage``
  (a regular file) and, besides it, nothing but shard folders (two lowercase hex
  digits) and ``lost+found`` (a store at the root of its own file system). An engine
  that opens such a store marks it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from kvplug import UNBOUNDED_BYTES
from kvplug_disk.config import DiskTierConfig
from kvplug_disk.files import PRIVATE_FILE

#: The file that says a folder is a kvplug disk store (any regular file of that name).
STORE_MARKER = ".kvplug-store"
MARKER_TEXT = b"kvplug disk store: records in shard folders 00..ff, see the kvplug-disk package\n"
#: The usage ledger's name (:mod:`kvplug_disk.ledger`), which every store has had.
_LEDGER = ".kvplug-usage"
_SHARD_NAME = re.compile(r"[0-9a-f]{2}")
#: Entries of an unmarked folder named in the refusal, at most.
_SHOWN = 3


def disk_location_config(location: str, options: Mapping[str, Any]) -> DiskTierConfig | None:
    """The inspection config of a folder path or ``file://`` URL, or ``None`` for other URLs.

    Raises ``ValueError`` when the location is not a disk store, or when ``options``
    holds something a folder does not take.
    """
    if "://" in location and not location.startswith("file://"):
        return None
    given = sorted(name for name, value in options.items() if value is not None)
    if given:
        raise ValueError(f"option(s) {', '.join(given)} do not apply to a disk store (a folder)")
    path = location.removeprefix("file://")
    require_disk_store(path)
    return DiskTierConfig(path=path, max_bytes=UNBOUNDED_BYTES)  # opened for inspection: never evict


def require_disk_store(path: str) -> None:
    """Raise ``ValueError`` (``not a kvplug store: <path> ...: why``) unless ``path`` is a
    disk store by the rule of the module docstring. Only lists the folder: nothing is
    created, changed or removed, whatever the answer."""

    def refuse(why: str) -> ValueError:
        return ValueError(f"not a kvplug store: {path} {why}; nothing was created or changed")

    try:
        info = os.stat(path)  # a link to the store folder is fine; links inside it are not followed
    except FileNotFoundError:
        raise refuse("does not exist") from None
    except (OSError, ValueError) as exc:
        raise refuse(f"cannot be read ({getattr(exc, 'strerror', None) or exc})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise refuse("is not a folder")
    try:
        with os.scandir(path) as entries:
            found = {entry.name: _kind(entry) for entry in entries}
    except OSError as exc:
        raise refuse(f"cannot be listed ({exc.strerror})") from None
    if found.get(STORE_MARKER) == "file":
        return
    others = sorted(
        name
        for name, kind in found.items()
        if not (kind == "folder" and (_SHARD_NAME.fullmatch(name) or name == "lost+found"))
        and not (name == _LEDGER and kind == "file")
    )
    if found.get(_LEDGER) == "file" and not others and any(_SHARD_NAME.fullmatch(name) for name in found):
        return
    if others:
        shown = ", ".join(others[:_SHOWN]) + (f" and {len(others) - _SHOWN} more" if len(others) > _SHOWN else "")
        what = f"it holds {shown}"
    elif _LEDGER not in found:
        what = f"it has no {_LEDGER} ledger"
    else:
        what = "it has no shard folders 00..ff"
    raise refuse(
        f"has no {STORE_MARKER} marker (a disk tier writes one where it keeps records), and is no store of an "
        f"earlier kvplug either (those hold {_LEDGER} and shard folders 00..ff only: {what})"
    )


def mark_store(root_fd: int) -> bool:
    """Write the marker into the store folder open as ``root_fd`` unless it is there;
    ``False`` when it cannot be written (a folder this user may not write)."""
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(STORE_MARKER, flags, PRIVATE_FILE, dir_fd=root_fd)
    except FileExistsError:
        return True
    except OSError:
        return False
    try:
        os.write(fd, MARKER_TEXT)
    except OSError:  # an empty marker marks as well (any regular file of its name)
        pass
    finally:
        os.close(fd)
    return True


def _kind(entry: os.DirEntry[str]) -> str:
    """``folder``, ``file`` (regular), or ``other`` (a link, a socket...), never following a link."""
    try:
        if entry.is_dir(follow_symlinks=False):
            return "folder"
        return "file" if entry.is_file(follow_symlinks=False) else "other"
    except OSError:
        return "other"
