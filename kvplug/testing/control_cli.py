"""Run ``kvplug ctl`` as an operator does, in a subprocess, for adapter tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


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
