"""What a disk tier can tell about its folder before an engine starts, without touching it.

An engine adapter runs this where the engine validates its configuration, so a folder
under a file, or under a parent this process cannot write, fails in seconds with the
config entry named, instead of after the model has loaded.
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


def _check_writable(folder: Path, path: Path) -> None:
    if not os.access(folder, os.W_OK | os.X_OK):
        where = "" if folder == path else f" (it would be created in {folder})"
        raise ValueError(f"{path} is not writable by this process{where}")
