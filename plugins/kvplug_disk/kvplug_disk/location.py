"""Which locations ``kvplug store`` opens as a disk store, and the check that one is.

A disk store is a folder holding shard folders ``00``..``ff``. Opening a disk tier
creates them, so pointed at the wrong folder (a typo, a home directory) an
inspection would litter it: a location is refused, before anything is opened or
created, unless a disk tier wrote it.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from typing import Any

from kvplug import UNBOUNDED_BYTES
from kvplug_disk.config import DiskTierConfig

_SHARD_NAME = re.compile(r"[0-9a-f]{2}")


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
    """Raise ``ValueError`` (``not a kvplug store: ...``) unless ``path`` is a folder a disk tier wrote."""

    def refuse(why: str) -> ValueError:
        return ValueError(f"not a kvplug store: {why}")

    try:
        info = os.stat(path)  # a link to the store folder is fine; links inside it are not followed
    except FileNotFoundError:
        raise refuse("no such folder") from None
    except (OSError, ValueError) as exc:
        raise refuse(f"cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not stat.S_ISDIR(info.st_mode):
        raise refuse("not a folder")
    try:
        with os.scandir(path) as entries:
            shards = sum(1 for e in entries if _SHARD_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False))
    except OSError as exc:
        raise refuse(f"cannot list it ({exc.strerror})") from None
    if not shards:
        raise refuse("the folder has no shard folders 00..ff, so no disk tier wrote it; nothing was created")
