"""What a disk tier can tell about its folder before an engine starts, without touching it.

An engine adapter runs this where the engine validates its configuration, and
``kvplug config validate`` runs it too, so a folder under a file, under a parent this process
cannot write, or on a file system no file can be made on (``/proc``, ``/sys``, a read-only
mount) fails in seconds with the config entry named, instead of after the model has loaded.
``os.access`` alone says yes to root for ``/proc``: the mount's type and flags are checked too.
"""

from __future__ import annotations

import os
from pathlib import Path


def check_folder(path: Path) -> None:
    """Raise ``ValueError`` when ``path`` cannot be (or be used as) the tier's folder.

    Creates nothing: an existing ``path`` must be a folder this process can write; a
    missing one needs its nearest existing ancestor to be a writable folder, since the
    tier creates the missing parts.
    """
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{path} is not a folder")
        _check_writable(path, path)
        return
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ValueError(f"cannot create {path}: {ancestor} is not a folder")
    _check_writable(ancestor, path)


#: Kernel file systems where no tier folder can be made, whatever the permission bits say.
PSEUDO_FILESYSTEMS = frozenset(
    {"proc", "sysfs", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "configfs", "pstore",
     "efivarfs", "bpf", "devpts", "mqueue", "hugetlbfs", "fusectl", "binfmt_misc", "autofs"}
)  # fmt: skip
MOUNTINFO = Path("/proc/self/mountinfo")


def _check_writable(folder: Path, path: Path) -> None:
    where = "" if folder == path else f" (it would be created in {folder})"
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{path} is not writable by this process{where}")
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        raise ValueError(f"{path} is on a read-only file system{where}")
    fstype = mount_type(folder)
    if fstype in PSEUDO_FILESYSTEMS:
        raise ValueError(f"{path} is on the kernel's {fstype} file system, where no tier folder can be made{where}")


def mount_type(folder: Path) -> str | None:
    """The file system type of the mount holding ``folder`` (``/proc/self/mountinfo``), or
    ``None`` where that file is not there (not Linux)."""
    try:
        lines = MOUNTINFO.read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(folder)
    best, best_type = "", None
    for line in lines:
        fields = line.split(" ")
        if " - " not in line or len(fields) < 5:
            continue
        # Mount points escape spaces and such as octal (\040).
        point = fields[4].encode().decode("unicode_escape")
        fstype = line.split(" - ", 1)[1].split(" ")[0]
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, fstype
    return best_type
