"""Tier ``disk`` in a folder that fights back: directories and links where records should
be, a FIFO where its ledger should be, no file descriptors left. Real files; the cases of
modes it may not override are in test_disk_permissions.py, a full disk in test_disk_full.py."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from kvplug.cli.main import app
from kvplug.testing import key_for, tier_context, value_for
from kvplug_disk import DiskTier, verify_folder


def make_disk_tier(path: Path, max_bytes: int | None = None, **options: object) -> DiskTier:
    if max_bytes is not None:
        options["max_bytes"] = max_bytes
    return DiskTier(DiskTier.Config(path=path, **options), tier_context())


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def record_path(root: Path, key: str) -> Path:
    return root / digest(key)[:2] / f"{digest(key)}.kvr"


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*.tmp")]


def store_cli(*args: str) -> Result:
    """``kvplug store ...`` in this process (a subprocess per command costs seconds of imports)."""
    return CliRunner().invoke(app, ["store", *args], env={"COLUMNS": "200"})


# --- a directory where a record should be ---------------------------------------


def test_a_directory_named_like_a_record_is_skipped_counted_and_never_a_hit(tmp_path: Path, caplog) -> None:
    keys = [key_for(f"d{i}") for i in range(6)]
    tier = make_disk_tier(tmp_path)
    tier.put([(key, value_for(key, 1000)) for key in keys])
    tier.close()
    planted = record_path(tmp_path, keys[0])
    planted.unlink()
    planted.mkdir()
    (planted / "inside").write_bytes(b"x")

    # Start-up over budget: evicting the directory fails, eviction goes on with the others.
    tier = make_disk_tier(tmp_path, 2_500)
    stats = tier.stats()
    assert stats.bytes_used <= 2_500 and stats.extra["foreign"] == 1
    assert tier.contains([keys[0]]) == [False]
    assert tier.get([keys[0]]) == [None]
    tier.put([(keys[0], value_for("again", 1000))])  # the rename onto the directory fails: counted, no raise
    assert tier.contains([keys[0]]) == [False] and tier.get([keys[0]]) == [None]
    tier.put([(key_for(f"n{i}"), value_for(f"n{i}", 1000)) for i in range(4)])  # eviction keeps working
    assert tier.contains([key_for("n3"), key_for("n2")]) == [True, True]
    assert tier.stats().bytes_used <= 2_500
    assert temp_files(tmp_path) == []
    assert sum(digest(keys[0]) in r.getMessage() for r in caplog.records) == 1  # logged once
    records = {r.digest for r in tier.records()}
    assert digest(keys[0]) not in records
    assert tier.read_record(digest(keys[0])) is None
    assert tier.delete_record(digest(keys[0])) is False
    tier.close()

    report = verify_folder(tmp_path, remove_corrupt=True)
    assert report.foreign == 1 and planted.is_dir()
    for command in ("verify", "gc", "stats", "ls"):
        result = store_cli(command, str(tmp_path))
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
        assert "IsADirectory" not in result.output and result.exit_code in (0, 1), result.output
    assert planted.is_dir() and (planted / "inside").exists()


# --- links ---------------------------------------------------------------------------


def test_a_shard_folder_replaced_by_a_link_is_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    key = key_for("linked")
    tier = make_disk_tier(root)
    tier.put([(key, value_for(key, 1000))])
    tier.close()
    shard = record_path(root, key).parent
    shutil.move(str(shard), str(outside / "moved"))  # a valid record, now outside the store
    shard.symlink_to(outside / "moved")

    tier = make_disk_tier(root, 10_000)
    assert tier.stats().items == 0  # start-up does not list records through the link
    assert tier.contains([key]) == [False] and tier.get([key]) == [None]
    other = key_for("other-in-same-shard")
    while digest(other)[:2] != digest(key)[:2]:
        other = key_for(other)
    tier.put([(other, value_for(other, 1000)), (key, value_for("new", 1000))])
    assert tier.contains([other, key]) == [False, False]
    assert tier.stats().extra["skipped_writes"] == 2 and tier.stats().extra["foreign"] == 1
    assert sorted(p.name for p in (outside / "moved").iterdir()) == [f"{digest(key)}.kvr"]
    tier.put([(key_for(f"f{i}"), value_for(f"f{i}", 3000)) for i in range(6)])  # evicts; never outside
    assert (outside / "moved" / f"{digest(key)}.kvr").exists()
    tier.close()
    report = verify_folder(root)
    inside = [p for p in root.glob("[0-9a-f][0-9a-f]/*.kvr") if not p.parent.is_symlink()]
    assert (report.ok, report.corrupt, report.foreign) == (len(inside), 0, 1)
    assert shard.is_symlink()


def test_a_record_file_that_is_a_link_is_not_read_nor_removed_through(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    victim, key = outside / "precious", key_for("l")
    tier = make_disk_tier(root)
    tier.put([(key, value_for(key, 1000))])
    tier.close()
    shutil.copy(record_path(root, key), victim)  # a valid record for key, outside the store
    record_path(root, key).unlink()
    record_path(root, key).symlink_to(victim)
    tier = make_disk_tier(root, 1_000)
    assert tier.contains([key]) == [False] and tier.get([key]) == [None]
    tier.put([(key_for(f"g{i}"), value_for(f"g{i}", 1000)) for i in range(3)])
    tier.remove([key])
    tier.close()
    assert victim.read_bytes()[:4] and victim.exists()


def test_store_verify_fails_on_a_link_planted_where_a_record_should_be(tmp_path: Path) -> None:
    root, outside = tmp_path / "cache", tmp_path / "outside"
    outside.mkdir()
    keys = [key_for(f"v{i}") for i in range(3)]
    tier = make_disk_tier(root)
    tier.put([(key, value_for(key, 1000)) for key in keys])
    tier.close()
    shutil.copy(record_path(root, keys[0]), outside / "record")  # a valid record, read through no link
    record_path(root, keys[0]).unlink()
    record_path(root, keys[0]).symlink_to(outside / "record")
    result = store_cli("verify", str(root))
    assert result.exit_code == 1, result.output
    rows = {line.split()[1]: line.split()[3] for line in result.output.splitlines() if line.count("│") == 3}
    assert (rows["ok"], rows["foreign"]) == ("2", "1")


NO_DESCRIPTORS_SCENARIO = """
import json, os, resource, sys
from pathlib import Path
from kvplug.testing import key_for, tier_context, value_for
from kvplug_disk import DiskTier
root = Path({root!r})
def tier():
    config = DiskTier.Config(path=root, max_bytes=10_000, fsync=False, write_threads=1, queue={{"mode": "sync"}})
    return DiskTier(config, tier_context())
mine = tier()  # opened while the folder is empty: to make room it must list the folder again
other = tier()
other.put([(key_for(f"o{{i}}"), value_for(f"o{{i}}", 1000)) for i in range(10)])  # the folder is full
other.close()
def fds():
    return sorted(int(name) for name in os.listdir("/proc/self/fd"))
highest = max(fds())
fillers = []
while (fd := os.open("/dev/null", os.O_RDONLY)) < highest:  # the free numbers below: the limit then counts exactly
    fillers.append(fd)
os.close(fd)
before = fds()
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
# Room for the three records' temp files: listing the folder to make room finds no descriptor left.
resource.setrlimit(resource.RLIMIT_NOFILE, (max(before) + 4, hard))
mine.put([(key_for(f"m{{i}}"), value_for(f"m{{i}}", 1000)) for i in range(3)])
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
out = {{"fds_left": len(fds()) - len(before), "temps": len(list(root.glob("*/*.tmp"))), "dropped": mine.stats().extra["dropped_puts"]}}
mine.close()
print(json.dumps(out))
"""


def test_a_put_that_fails_half_way_leaves_no_temp_file_or_descriptor(tmp_path: Path) -> None:
    """The process runs out of file descriptors while a put makes room (it lists the folder):
    the put is dropped, and the temp files already written are removed, their folders closed."""
    code = NO_DESCRIPTORS_SCENARIO.format(root=str(tmp_path / "cache"))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.splitlines()[-1])
    assert out == {"fds_left": 0, "temps": 0, "dropped": 3}, out


def test_a_fifo_planted_as_the_ledger_hangs_no_command_and_no_tier(tmp_path: Path, caplog) -> None:
    root = tmp_path / "cache"
    tier = make_disk_tier(root)
    tier.put([(key_for("f"), value_for("f", 1000))])
    tier.close()
    ledger = root / ".kvplug-usage"
    ledger.unlink()
    os.mkfifo(ledger)  # opened for reading, a FIFO waits for a writer that never comes
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvplug.cli.main", "store", "stats", str(root)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("kvplug store stats hung on a FIFO in place of the ledger")
    assert done.returncode == 0, done.stderr[-2000:]
    with caplog.at_level(logging.WARNING):
        tier = make_disk_tier(root, queue={"mode": "sync"})  # it failed to open: [Errno 29] Illegal seek
    assert tier.get([key_for("f")]) != [None]
    assert tier.stats().extra["folder_budget_shared"] == 0  # the budget counts this process's records
    assert ".kvplug-usage in the folder is a FIFO, not a regular file" in caplog.text
    tier.close()
