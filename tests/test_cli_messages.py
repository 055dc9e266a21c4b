"""What a user sees when a command has nothing to talk to, printed through a pipe as in a log.

``kvplug ctl stats`` with no engine printed ``[red]error:[/red] ...`` (markup turned off on a
string that held markup), ``kvplug ctl list`` an empty table, and every command torch's
"Failed to initialize NumPy" warning in a venv of kvplug's wheels (no numpy there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def kvplug(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    code = "import sys; from kvplug.cli.main import app; sys.argv[0] = 'kvplug'; app()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def no_engine_env(tmp_path: Path) -> dict[str, str]:
    """An empty private socket folder, and numpy hidden as in a wheel venv (torch then warns)."""
    sockets = tmp_path / "sockets"
    sockets.mkdir(mode=0o700)
    hidden = tmp_path / "hide-numpy" / "numpy"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'numpy' (hidden by the test)\", name='numpy')\n"
    )
    path = os.pathsep.join(filter(None, [str(hidden.parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "KVPLUG_LOOKUP_DIR": str(sockets), "PYTHONPATH": path, "COLUMNS": "80"}


@pytest.mark.parametrize("command", [["ctl", "stats"], ["ctl", "lookup", "-"], ["ctl", "clear", "--all"]])
def test_an_error_is_plain_text_without_markup(no_engine_env: dict[str, str], command: list[str]) -> None:
    result = kvplug(*command, env=no_engine_env)
    assert result.returncode == 2, result
    assert result.stderr.startswith("error: no engine is running"), result.stderr
    assert "[red]" not in result.stderr and "[/" not in result.stderr


def test_list_with_no_engine_says_so(no_engine_env: dict[str, str]) -> None:
    result = kvplug("ctl", "list", env=no_engine_env)
    assert result.returncode == 0, result
    assert result.stdout.startswith("no engine is running: no control socket in"), result.stdout
    assert "┃" not in result.stdout  # no empty table


def test_no_numpy_warning_on_any_command(no_engine_env: dict[str, str]) -> None:
    probe = subprocess.run(
        [sys.executable, "-c", "import warnings; warnings.simplefilter('error'); import torch"],
        env=no_engine_env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert "Failed to initialize NumPy" in probe.stderr, "the test no longer reproduces torch's warning"
    for command in (["ctl", "list"], ["plugins"], ["config", "validate"]):
        result = kvplug(*command, env=no_engine_env)
        assert "NumPy" not in result.stderr, (command, result.stderr)
