"""Fixtures of the kvplug-disk tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

SHM_ROOT = Path("/dev/shm")


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[Path]:
    """A fresh folder under /dev/shm (tmpfs), removed afterwards; where a host has no
    /dev/shm, the test's tmp_path instead (tier ``shm`` then warns and still works)."""
    if not SHM_ROOT.is_dir():
        yield tmp_path
        return
    folder = Path(tempfile.mkdtemp(prefix="kvplug-test-", dir=SHM_ROOT))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)
