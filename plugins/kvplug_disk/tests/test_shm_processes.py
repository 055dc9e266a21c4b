"""Tier ``shm`` across real processes: four share one folder and one budget while
some are SIGKILLed and restarted; a reader's mapped buffers outlive replaced records."""

from __future__ import annotations

import fcntl
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from disk_worker import KEYSPACE, VERSIONS, folder_value_bytes, key_of, value_of
from shm_worker import open_shm
from test_disk_processes import check_every_key, temp_files

from kvplug_disk import verify_folder
from kvplug_disk.ledger import LEDGER_NAME

WORKER = str(Path(__file__).with_name("shm_worker.py"))
PROCESSES = 4
RUN_SECONDS = 3.0


def largest_value() -> int:
    return max(len(value_of(i, v)) for i in range(KEYSPACE) for v in range(VERSIONS))


def locked_folder_bytes(path: Path) -> int:
    """Value bytes of the folder's record files, counted while holding the lock every
    tier of the folder takes to evict and rename (so no process is between the two)."""
    with (path / LEDGER_NAME).open("ab") as ledger:
        fcntl.flock(ledger, fcntl.LOCK_EX)
        try:
            return folder_value_bytes(path)
        finally:
            fcntl.flock(ledger, fcntl.LOCK_UN)


def wait_gone(pid: int) -> None:
    for _ in range(500):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} still runs after SIGKILL")


def test_four_processes_share_one_budget_through_sigkills_and_restarts(shm_dir: Path) -> None:
    budget = 600_000  # a quarter of the keyspace: every process evicts all the time
    chunk = largest_value()
    server = subprocess.Popen(
        [sys.executable, WORKER, "fork-server", str(shm_dir), str(budget)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    seeds = iter(range(1000))

    def start() -> int:
        server.stdin.write(f"{next(seeds)}\n")  # type: ignore[union-attr]
        server.stdin.flush()  # type: ignore[union-attr]
        ready = server.stdout.readline().split()  # type: ignore[union-attr]
        assert ready[:1] == ["ready"], f"churner did not start: {ready}"
        return int(ready[1])

    rng = random.Random(30)
    pids: list[int] = []
    samples: list[int] = []
    kills = 0
    try:
        pids = [start() for _ in range(PROCESSES)]
        deadline = time.monotonic() + RUN_SECONDS
        while time.monotonic() < deadline or len(samples) < 5:  # a loaded machine: fewer rounds in the time
            time.sleep(rng.uniform(0.05, 0.2))
            samples.append(locked_folder_bytes(shm_dir))
            victim = rng.randrange(PROCESSES)
            os.kill(pids[victim], signal.SIGKILL)
            wait_gone(pids[victim])
            kills += 1
            pids[victim] = start()  # a restart: a new process opens the folder as it is
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for pid in pids:
            wait_gone(pid)
        _, errors = server.communicate(timeout=30)
    assert "bad" not in errors, f"a churner read wrong bytes:\n{errors}"
    assert server.returncode == 0, errors
    # Every process was killed at some point (the last ones at the end), mid-write or not.
    left = temp_files(shm_dir)
    report = verify_folder(shm_dir)
    assert report.corrupt == 0, f"torn or corrupt record files: {report.corrupt_digests}"
    assert report.ok > 0
    assert len(samples) >= 5 and max(samples) <= budget + PROCESSES * chunk, (max(samples), budget)
    assert folder_value_bytes(shm_dir) <= budget + PROCESSES * chunk
    tier = open_shm(str(shm_dir), budget)
    try:
        stats = tier.stats()
        assert stats.extra["temps_removed"] == len(left) and not temp_files(shm_dir)  # dead writers' temps
        assert check_every_key(tier) == report.ok  # every record byte-identical to a value stored under its key
        assert tier.stats().extra["corrupt"] == 0
    finally:
        tier.close()
    print(f"\n{kills} kills, {len(left)} temps left, folder bytes max {max(samples)} (budget {budget})")


def test_a_held_buffer_keeps_its_bytes_when_another_process_replaces_or_removes_the_record(shm_dir: Path) -> None:
    tier = open_shm(str(shm_dir))
    try:
        tier.put([(key_of(1), value_of(1, 0)), (key_of(2), value_of(2, 0))])
        held_1, held_2 = tier.get([key_of(1), key_of(2)])
        assert held_1 is not None and held_2 is not None
        path_1 = next(shm_dir.glob("*/*.kvr"))  # any record: its inode must change or vanish
        inodes = {p: p.stat().st_ino for p in shm_dir.glob("*/*.kvr")}
        # Another process renames version 1 of key 1 over its record and unlinks key 2's.
        subprocess.run([sys.executable, WORKER, "replace", str(shm_dir), "1", "2"], check=True, timeout=60)
        assert bytes(held_1) == value_of(1, 0) and bytes(held_2) == value_of(2, 0)
        now_1, now_2 = tier.get([key_of(1), key_of(2)])
        assert now_2 is None and now_1 is not None and bytes(now_1) == value_of(1, 1)
        assert bytes(held_1) == value_of(1, 0)  # still, beside the new mapping
        remaining = list(shm_dir.glob("*/*.kvr"))
        assert len(remaining) == 1 and inodes.get(remaining[0]) != remaining[0].stat().st_ino, path_1
    finally:
        tier.close()
