"""Fixtures of the kvplug-disk tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tenant_worker import Worker

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


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs of 4 KiB pages mounted for the test and unmounted after it: a full
    shared-memory folder without filling the host's /dev/shm. Needs root (CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    point = tmp_path / "tmpfs"
    point.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m,huge=never,mode=0700", "tmpfs", str(point)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield point
    finally:
        # Lazily if still busy (a test that failed holding a mapping): never left mounted.
        if subprocess.run(["umount", str(point)], capture_output=True, timeout=60).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=60)


@pytest.fixture(params=["disk", "shm"])
def kind(request: pytest.FixtureRequest) -> str:
    """Each folder tier: ``disk``, and ``shm`` (the same records in shared memory)."""
    return str(request.param)


@pytest.fixture
def folder(kind: str, tmp_path: Path, shm_dir: Path) -> Path:
    """A fresh folder for a ``kind`` tier (a test file may name its own)."""
    return shm_dir if kind == "shm" else tmp_path / "store"


@pytest.fixture
def started(kind: str, folder: Path) -> Iterator[list[Worker]]:
    """The :mod:`tenant_worker` processes a test starts, closed after it."""
    workers: list[Worker] = []
    yield workers
    for worker in workers:
        worker.close()
