"""What a user sees when a command has nothing to talk to, printed through a pipe as in a log.

``kvplug ctl stats`` with no engine printed ``[red]error:[/red] ...`` (markup turned off on a
string that held markup), ``kvplug ctl list`` an empty table, and every command torch's
"Failed to initialize NumPy" warning in a venv of kvplug's wheels (no numpy there).
"""

from __future__ import annotations

import os
import socket
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


def test_plugins_fit_80_columns_without_cutting_a_name(no_engine_env: dict[str, str]) -> None:
    """``kvplug plugins`` cut class names to ``kvplug.builtins.raw_s…`` at 80 columns."""
    result = kvplug("plugins", env=no_engine_env)
    assert result.returncode == 0, result
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in result.stdout, result.stdout
    assert "kvplug.builtins.raw_serializer (builtin)" in lines and "  distribution: kvplug" in lines


def test_a_table_that_fits_is_drawn_and_one_that_does_not_is_a_long_form() -> None:
    import io

    from rich.console import Console
    from rich.table import Table

    from kvplug.cli.console import print_table

    def shown(*rows: tuple[str, ...], width: int = 80) -> str:
        table = Table(title="t")
        for column in ("name", "medium", "budget"):
            table.add_column(column)
        for row in rows:
            table.add_row(*row)
        out = Console(file=io.StringIO(), width=width)
        print_table(table, out)
        return out.file.getvalue()  # type: ignore[attr-defined]

    assert "┃ name  ┃ medium ┃ budget ┃" in shown(("0:cpu", "memory", "1 GiB"))
    wide = shown(("0:disk " + "x" * 60, "disk", "200 GiB"), ("1:s3", "remote tiers[0]", "unbounded"))
    assert wide.splitlines() == [
        "t",
        "0:disk " + "x" * 60,
        "  medium: disk",
        "  budget: 200 GiB",
        "1:s3",
        "  medium: remote tiers[0]",
        "  budget: unbounded",
    ]


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_a_timeout_no_socket_can_wait_is_refused_naming_it(no_engine_env: dict[str, str], value: str) -> None:
    """With a socket to ask, ``--timeout nan`` (or ``inf``) ended in a ValueError (OverflowError)
    traceback from the socket's settimeout; ``-1`` waited 10 ms."""
    path = Path(no_engine_env["KVPLUG_LOOKUP_DIR"]) / "ctl-listening.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:  # listens, never answers
        listener.bind(str(path))
        listener.listen()
        result = kvplug("ctl", "stats", "--timeout", value, env=no_engine_env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and "--timeout" in result.stderr, result.stderr
    assert repr(float(value)) in result.stderr, result.stderr


def test_a_socket_folder_another_user_could_control_is_an_error_not_a_traceback(
    no_engine_env: dict[str, str], tmp_path: Path
) -> None:
    """$KVPLUG_LOOKUP_DIR open to others, or another user's (root only), ended every ctl command
    in an UnsafeSocketPathError traceback."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    folders = [shared]
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)  # nobody's
        folders.append(theirs)
    for folder in folders:
        for command in (["ctl", "stats"], ["ctl", "list"]):
            result = kvplug(*command, env={**no_engine_env, "KVPLUG_LOOKUP_DIR": str(folder)})
            assert result.returncode == 2, result.stderr
            assert result.stderr.startswith(f"error: KVPLUG_LOOKUP_DIR={folder} cannot hold kvplug sockets"), result
            assert "Traceback" not in result.stderr


def test_no_engine_names_the_folder_it_looked_in(no_engine_env: dict[str, str], tmp_path: Path) -> None:
    """A wrong --socket-dir (or an engine of another user, in its own folder) said only "no engine is running"."""
    for folder, missing in (
        (Path(no_engine_env["KVPLUG_LOOKUP_DIR"]), ""),
        (tmp_path / "nowhere", " (no such folder)"),
    ):
        result = kvplug("ctl", "stats", "--socket-dir", str(folder), env=no_engine_env)
        assert result.returncode == 2, result.stderr
        message = " ".join(result.stderr.split())
        assert f"error: no engine is running: no control socket in {folder}{missing}" in message, message
