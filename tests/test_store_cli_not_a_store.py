"""``kvplug store verify|stats|ls|gc`` on a path that is not a store.

It must say so, create nothing and exit non-zero: a typo in a path must not become an empty store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMANDS = ("verify", "stats", "ls", "gc")


def snapshot(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def run_all(location: str, cwd: Path) -> list[subprocess.CompletedProcess[str]]:
    env = dict(os.environ, COLUMNS="250")
    env.pop("KVPLUG_PLUGINS", None)
    # One interpreter for the four commands: each is a typer invocation of the real CLI app.
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvplug.cli.main import app\n"
        "for command in sys.argv[2:]:\n"
        "    result = CliRunner().invoke(app, ['store', command, sys.argv[1]])\n"
        "    print(f'@@ {command} {result.exit_code} {type(result.exception).__name__}')\n"
        "    print(result.output)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, location, *COMMANDS],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return [
        subprocess.CompletedProcess(part.split()[0], int(part.split()[1]), part, part.split()[2])
        for part in done.stdout.split("@@ ")[1:]
    ]


@pytest.mark.parametrize("kind", ["empty folder", "unrelated folder", "missing folder", "a file", "file url"])
def test_store_commands_refuse_a_path_that_is_not_a_store(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "target"
    if kind in ("empty folder", "file url"):
        target.mkdir()
    elif kind == "unrelated folder":
        (target / "src").mkdir(parents=True)
        (target / "notes.txt").write_text("not a cache")
    elif kind == "a file":
        target.write_text("hello")
    location = f"file://{target}" if kind == "file url" else str(target)
    before = snapshot(tmp_path)
    for result in run_all(location, cwd=tmp_path):
        output = " ".join(result.stdout.split())
        assert result.returncode != 0, (result.args, output)
        assert result.stderr in ("SystemExit", "NoneType"), (result.args, output)  # an exit, not a crash
        assert "not a kvplug store" in output, (result.args, output)
        assert snapshot(tmp_path) == before, result.args
