"""Tier ``disk`` in a folder whose modes fight back: a record it may not delete, shard
folders it may not open or search. Real files and real permissions: each case runs in a
process that is not root, since root may delete anything."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

from test_disk_hostile import digest, make_disk_tier, record_path, temp_files

from kvplug.testing import key_for, value_for

HERE = Path(__file__).parent

# --- a record the process may not delete -------------------------------------------

SCENARIO = """
import json, logging, sys
sys.path.insert(0, {here!r})
from kvplug_disk import DiskTier, verify_folder
from kvplug.testing import key_for, tier_context, value_for
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
root, locked_key, budget = {root!r}, {locked_key!r}, {budget}
out = {{}}
tier = DiskTier(DiskTier.Config(path=root, max_bytes=budget), tier_context())
out["startup_bytes"] = tier.stats().bytes_used
out["contains"] = tier.contains([locked_key])
out["get"] = tier.get([locked_key]) == [None]
tier.put([(locked_key, value_for("new", 1000))])
tier.put([(key_for(f"m{{i}}"), value_for(f"m{{i}}", 1000)) for i in range(5)])
tier.flush()
out["new_hits"] = tier.contains([key_for("m4"), key_for("m3")])
out["contains_after"] = tier.contains([locked_key])
stats = tier.stats()
out["bytes"] = stats.bytes_used
out["skipped_writes"] = stats.extra["skipped_writes"]
out["undeletable"] = stats.extra["undeletable"]
import ctypes
import hashlib
d = hashlib.sha256(locked_key.encode()).hexdigest()
out["delete"] = tier.delete_record(d)
tier.close()
report = verify_folder(root, remove_corrupt=True)
out["verify"] = [report.corrupt, report.removed, report.undeletable]
print(json.dumps(out))
"""


def _without_root_privileges() -> None:
    """In the child, before exec: drop the capabilities that let root ignore file
    permissions (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER) from the bounding
    set, so the exec'ed process, still uid 0, obeys mode bits like any user."""
    libc = ctypes.CDLL(None, use_errno=True)
    for capability in (1, 2, 3):
        if libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


PR_CAPBSET_DROP = 24


def run_obeying_modes(code: str) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh Python that obeys mode bits, even as root."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=_without_root_privileges if os.geteuid() == 0 else None,
    )


def test_a_record_the_process_may_not_delete_is_skipped_logged_once_and_counted(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    keys = [key_for(f"p{i}") for i in range(8)]
    locked_key = keys[0]
    tier = make_disk_tier(root)
    for key in keys:  # one put each: the locked key is the oldest, the first victim
        tier.put([(key, value_for(key, 1000))])
    tier.close()
    with record_path(root, locked_key).open("r+b") as damaged:  # so that verify wants to remove it
        damaged.seek(500)
        damaged.write(b"\xff" * 8)
    os.utime(record_path(root, locked_key), ns=(1, 1))  # still the oldest: the first victim
    shard = record_path(root, locked_key).parent
    shard.chmod(0o555)  # its owner may read it but neither remove nor add entries
    try:
        code = SCENARIO.format(here=str(HERE), root=str(root), locked_key=locked_key, budget=4_000)
        result = run_obeying_modes(code)
    finally:
        shard.chmod(0o755)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["startup_bytes"] <= 4_000
    assert out["contains"] == [False] and out["get"] and out["contains_after"] == [False]
    assert out["new_hits"] == [True, True] and out["bytes"] <= 4_000
    assert out["undeletable"] == 1 and out["skipped_writes"] == 1
    assert out["delete"] is False
    assert out["verify"] == [1, 0, 1]
    assert sum(digest(locked_key) in line for line in result.stderr.splitlines()) == 1, result.stderr  # logged once
    assert temp_files(root) == []
    assert record_path(root, locked_key).exists()


SHARDS_SCENARIO = """
import json, logging, os, sys
from typer.testing import CliRunner
from kvplug.cli.main import app
from kvplug_disk import DiskTier, verify_folder
from kvplug.testing import key_for, tier_context, value_for
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
root, locked, listed_only, served = {root!r}, {locked!r}, {listed_only!r}, {served!r}
fds = len(os.listdir("/proc/self/fd"))
tier = DiskTier(DiskTier.Config(path=root, queue={{"mode": "sync"}}), tier_context())
out = {{"get": [v is not None for v in tier.get([locked, listed_only, served])]}}
tier.put([(locked, value_for("again", 1000)), (key_for("new"), value_for("new", 1000))])
out["after_put"] = tier.contains([locked, key_for("new")])
out["foreign"] = tier.stats().extra["foreign"]
tier.close()
out["fds_left"] = len(os.listdir("/proc/self/fd")) - fds
report = verify_folder(root)
out["verify_folder"] = [report.ok, report.foreign, report.unreadable]
result = CliRunner().invoke(app, ["store", "verify", root], env={{"COLUMNS": "200"}})
out["cli"] = [result.exit_code, [line for line in result.output.splitlines() if "foreign" in line]]
print(json.dumps(out))
"""


def test_shard_folders_this_user_may_not_open_or_search_are_left_alone_and_reported(tmp_path: Path) -> None:
    """A shard folder of another user (say, left by a run as root) keeps no tier from opening:
    its records are misses, the other shards serve, and ``kvplug store verify`` fails naming it."""
    root = tmp_path / "cache"
    keys = [key_for(f"s{i}") for i in range(40)]
    tier = make_disk_tier(root)
    tier.put([(key, value_for(key, 1000)) for key in keys])
    tier.close()
    locked, listed_only = keys[0], next(k for k in keys if digest(k)[:2] != digest(keys[0])[:2])
    served = next(k for k in keys if digest(k)[:2] not in (digest(locked)[:2], digest(listed_only)[:2]))
    closed, readable = record_path(root, locked).parent, record_path(root, listed_only).parent
    closed.chmod(0o000)  # may not be opened
    readable.chmod(0o400)  # may be listed, not searched: no file in it can be opened
    try:
        code = SHARDS_SCENARIO.format(root=str(root), locked=locked, listed_only=listed_only, served=served)
        result = run_obeying_modes(code)
    finally:
        closed.chmod(0o700)
        readable.chmod(0o700)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out["get"] == [False, False, True]
    assert out["after_put"] == [False, True]
    assert out["foreign"] == 2 and out["fds_left"] == 0
    assert f"{root}/{closed.name} is not a folder this user may open" in result.stderr
    left_alone = sum(digest(k)[:2] in (closed.name, readable.name) for k in keys)
    assert out["verify_folder"][:2] == [41 - left_alone, 2]  # the 40 and the new record
    assert out["cli"][0] == 1 and any("2" in line for line in out["cli"][1]), out["cli"]
    assert record_path(root, locked).exists()  # nothing in them was touched
