"""What file system holds a folder, and how it backs files with pages, read from the mount table.

The shm tier says at start whether its folder is on tmpfs (``file_system``) and whether
that tmpfs maps records with 2 MiB pages (``huge_pages``): what a record's first read in a
process costs beyond its checksum (:mod:`kvplug_disk.shm`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: File systems that keep files in memory: a mapping of them is a mapping of RAM.
MEMORY_FILE_SYSTEMS = frozenset({"tmpfs", "ramfs"})
_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")
#: The host's switch of huge pages for tmpfs; ``force`` and ``deny`` override every mount's ``huge=``.
SHMEM_HUGE_SETTING = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


def file_system_of(path: Path, mounts: str = "/proc/self/mounts") -> str:
    """The type of the file system mounted where ``path`` lives (``tmpfs``, ``ext4``),
    ``unknown`` where that cannot be read."""
    return mount_of(path, mounts)[0]


def huge_pages_of(path: Path, mounts: str = "/proc/self/mounts", host: str = SHMEM_HUGE_SETTING) -> str:
    """How tmpfs at ``path`` backs files with 2 MiB pages: its mount's ``huge=`` option
    (``never`` when absent), unless the host forces or denies huge pages on every mount
    (``host``); ``-`` off tmpfs. A mapping of 2 MiB pages costs a few page-table entries
    instead of 512 per 2 MiB: what a read of this tier costs beyond its checksum."""
    found, options = mount_of(path, mounts)
    if found != "tmpfs":
        return "-"
    try:
        with open(host, encoding="utf-8") as setting:
            chosen = re.search(r"\[(\w+)\]", setting.read())
    except OSError:
        chosen = None
    if chosen is not None and chosen.group(1) in ("force", "deny"):
        return "always" if chosen.group(1) == "force" else "never"
    return next((o.removeprefix("huge=") for o in options.split(",") if o.startswith("huge=")), "never")


def mount_of(path: Path, mounts: str = "/proc/self/mounts") -> tuple[str, str]:
    """The type and the options of the file system mounted where ``path`` lives (its
    deepest mount point), from ``mounts``; ``("unknown", "")`` where that cannot be read."""
    target = os.path.realpath(path)
    found, depth = ("unknown", ""), -1
    try:
        with open(mounts, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                fields = line.split()
                if len(fields) < 4:
                    continue
                point = _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), fields[1])
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= depth:  # a later mount over the same point hides earlier ones
                    found, depth = (fields[2], fields[3]), len(point)
    except OSError:
        return ("unknown", "")
    return found
