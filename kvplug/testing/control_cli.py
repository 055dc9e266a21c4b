"""Run ``kvplug ctl`` as an operator does, in a subprocess, for adapter tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


def run_ctl(socket_dir: Path, *args: str, expect_rc: int = 0, timeout_s: float = 120) -> Any:
    """``kvplug ctl ARGS --json`` against the engines whose control sockets are in
    ``socket_dir`` (``KVPLUG_LOOKUP_DIR``): its JSON reply when it exits 0, else its
    stderr; the exit status must be ``expect_rc`` (2: a refused command)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", "ctl", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, "KVPLUG_LOOKUP_DIR": str(socket_dir)},
    )
    assert done.returncode == expect_rc, f"kvplug ctl {' '.join(args)} exited {done.returncode}:\n{done.stderr}"
    return json.loads(done.stdout) if expect_rc == 0 else done.stderr


@pytest.fixture
def socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private socket folder of its own (``KVPLUG_LOOKUP_DIR``) for the control servers a test
    starts: import it into a test module to use it."""
    folder = Path(tempfile.mkdtemp(prefix="kvctl-"))  # 0700; short: a socket path has ~100 bytes at most
    monkeypatch.setenv("KVPLUG_LOOKUP_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
