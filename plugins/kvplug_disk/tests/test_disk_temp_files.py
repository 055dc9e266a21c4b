"""Temp files of writes in flight in a shared disk folder: a tier that starts removes only those
whose writer is provably gone, never one a live process of another PID namespace is writing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvplug.testing import tier_context
from kvplug_disk import DiskTier

DIGEST = "ab" + "0" * 62

#: A writer in a container of its own (a PID namespace with some history: its pid is not 1),
#: stopped between writing its temp file and renaming it; it renames on a line on stdin.
WRITER = r"""
import os, sys
from pathlib import Path
from kvplug_disk.files import RecordFolder
folder = RecordFolder(Path(sys.argv[1]), fsync=False)
temp = folder.write_temp(sys.argv[2], b"h" * 64, memoryview(b"v" * 1000))
print("written", os.getpid(), flush=True)
sys.stdin.readline()
try:
    folder.publish(temp, sys.argv[2])
    print("renamed", flush=True)
except OSError as exc:
    print(f"rename failed: {exc}", flush=True)
"""
OPENER = """
import sys
from kvplug.testing import tier_context
from kvplug_disk import DiskTier
tier = DiskTier(DiskTier.Config(path=sys.argv[1]), tier_context())
print(tier.stats().extra["temps_removed"])
tier.close()
"""


def in_own_pid_namespace(*command: str, before: int) -> list[str]:
    """``command`` run in a new PID namespace, after ``before`` processes ran there (its pid is past them)."""
    shell = f'for i in $(seq {before}); do /bin/true; done; "$@"'
    return ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", shell, "sh", *command]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="new PID namespaces need root")
def test_a_tier_starting_in_another_pid_namespace_keeps_a_live_writers_temp_file(tmp_path: Path) -> None:
    DiskTier(DiskTier.Config(path=tmp_path, queue={"mode": "sync"}), tier_context()).close()
    writer = subprocess.Popen(
        in_own_pid_namespace(sys.executable, "-c", WRITER, str(tmp_path), DIGEST, before=40),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdin is not None and writer.stdout is not None
    try:
        written = writer.stdout.readline().split()
        if not written:
            pytest.skip("cannot make a PID namespace here (unshare failed)")
        assert written[0] == "written" and written[1] != "1"
        opened = subprocess.run(
            in_own_pid_namespace(sys.executable, "-c", OPENER, str(tmp_path), before=5),  # no pid ~40 there
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert opened.returncode == 0, opened.stderr
        assert opened.stdout.strip() == "0"  # the writer's temp file was kept
        writer.stdin.write("\n")
        writer.stdin.flush()
        assert writer.stdout.readline().strip() == "renamed"
    finally:
        writer.kill()
        writer.wait(30)
    assert (tmp_path / DIGEST[:2] / f"{DIGEST}.kvr").exists()
