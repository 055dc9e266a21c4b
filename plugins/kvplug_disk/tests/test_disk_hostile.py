"""Tier ``disk`` in a folder that fights back: entries it may
not delete, directories and links where records should be. Real files and real
permissions: the undeletable case runs in a process that is not root, since root may
delete anything."""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from kvplug import TierChain
from kvplug.cli.main import app
from kvplug.core.metrics import EngineMetrics
from kvplug.testing import key_for, tier_context, value_for
from kvplug_disk import DiskTier, verify_folder

HERE = Path(__file__).parent


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


# --- a full disk ------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 4 MiB file system (tmpfs), so ENOSPC is the kernel's own."""
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m,mode=0755", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        if os.geteuid() != 0:
            pytest.skip(f"mounting a small tmpfs needs root (CI runs as root): {mounted.stderr.strip()}")
        pytest.fail(f"cannot mount a 4 MiB tmpfs: {mounted.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_a_full_disk_evicts_the_tiers_own_records_to_make_room(small_fs: Path) -> None:
    tier = make_disk_tier(small_fs / "cache", 64 * 1024**2)  # budget far above the disk
    keys = [key_for(f"full{i}") for i in range(40)]
    for key in keys:  # 8 MB through a 4 MiB disk
        tier.put([(key, value_for(key, 200_000))])
        assert tier.contains([key]) == [True], key
        assert bytes(tier.get([key])[0]) == value_for(key, 200_000)
    stats = tier.stats()
    assert stats.errors == 0 and stats.extra["enospc_evictions"] > 0 and stats.evictions > 0
    assert 5 < stats.items < 21
    assert temp_files(small_fs) == []
    tier.close()


def test_a_disk_full_of_other_data_counts_errors_in_prometheus_and_warns_once_per_burst(
    small_fs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (small_fs / "other").open("wb", buffering=0) as filler:  # someone else's data fills the disk
        try:
            while True:
                filler.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    (small_fs / "other").unlink()
    (small_fs / "other").write_bytes(b"\0" * (4 * 1024**2 - 150_000))  # leaves room for the tier's folders only
    metrics = EngineMetrics()
    config = DiskTier.Config(path=small_fs / "cache", max_bytes=64 * 1024**2)
    chain = TierChain([DiskTier(config, tier_context(metrics=metrics))], metrics)
    caplog.set_level(logging.WARNING)
    for i in range(12):
        chain.put([(key_for(f"nospace{i}"), value_for(f"nospace{i}", 200_000))])
    chain.flush()
    stats = chain.tiers[0].stats()
    assert stats.errors == 12 and stats.extra["enospc"] == 12 and stats.items == 0
    assert metrics.value("kvplug_tier_errors_total", tier="0:disk", op="write") == 12
    warnings = [r for r in caplog.records if "No space left" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert temp_files(small_fs) == []
    chain.close()


def test_a_tier_opened_on_a_full_disk_starts_and_counts_its_failed_writes(small_fs: Path) -> None:
    with (small_fs / "other").open("wb", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    tier = make_disk_tier(small_fs / "cache", 64 * 1024**2)
    tier.put([(key_for("no room"), value_for("no room", 100_000))])
    assert tier.contains([key_for("no room")]) == [False]
    assert tier.stats().extra["enospc"] == 1
    (small_fs / "other").unlink()  # room again: the tier works, and its shared total with it
    tier.put([(key_for("room"), value_for("room", 100_000))])
    assert tier.contains([key_for("room")]) == [True]
    assert tier.stats().extra["folder_bytes"] == 100_000
    tier.close()
