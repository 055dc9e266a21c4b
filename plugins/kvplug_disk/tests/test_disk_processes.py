"""Tier ``disk`` across real processes: SIGKILL mid-write, restart, a shared folder."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from disk_worker import KEYSPACE, folder_value_bytes, holding_the_folder_lock, key_of, open_tier, value_of, versions_of

from kvplug_disk import verify_folder

WORKER = str(Path(__file__).with_name("disk_worker.py"))
CRASH_ITERATIONS = int(os.environ.get("KVPLUG_TEST_CRASH_ITERATIONS", "50"))


def start_writer(path: Path, seed: int, writer: str, budget: int) -> subprocess.Popen[str]:
    """A writer process that has opened its tier and is writing in a loop."""
    process = subprocess.Popen(
        [sys.executable, WORKER, "write-forever", str(path), str(seed), writer, str(budget)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = process.stdout.readline()  # type: ignore[union-attr]
    if not line.startswith("ready"):
        process.kill()
        raise AssertionError(f"writer did not start: {line!r} {process.communicate()[1]}")
    return process


def check_every_key(tier) -> int:
    """Every key reads back as nothing or as exactly one value written under it; hits."""
    keys = [key_of(i) for i in range(KEYSPACE)]
    hits = 0
    for index, value in enumerate(tier.get(keys)):
        if value is not None:
            assert bytes(value) in versions_of(index), f"wrong bytes under key {index} ({len(value)} bytes)"
            hits += 1
    return hits


def temp_files(path: Path) -> list[Path]:
    return list(path.glob("*/*.tmp"))


def test_sigkill_at_random_moments_never_leaves_a_torn_record(tmp_path: Path) -> None:
    rng = random.Random(1234)
    budget = 1_500_000  # below the keyspace's size, so writers also evict while killed
    killed_mid_write = temps_seen = 0
    server = subprocess.Popen(
        [sys.executable, WORKER, "fork-server", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        for iteration in range(CRASH_ITERATIONS):
            writer = "inline" if iteration % 2 == 0 else "background"
            server.stdin.write(f"{iteration} {writer} {budget}\n")  # type: ignore[union-attr]
            server.stdin.flush()  # type: ignore[union-attr]
            ready = server.stdout.readline().split()  # type: ignore[union-attr]
            assert ready[:1] == ["ready"], f"writer did not start: {ready}"
            time.sleep(rng.uniform(0.0, 0.15))
            os.kill(int(ready[1]), signal.SIGKILL)
            assert server.stdout.readline().split() == ["dead", str(int(signal.SIGKILL))]  # type: ignore[union-attr]
            left = temp_files(tmp_path)
            temps_seen += len(left)
            killed_mid_write += bool(left)
            report = verify_folder(tmp_path)
            assert report.corrupt == 0, f"iteration {iteration}: torn or corrupt record files {report.corrupt_digests}"
            tier = open_tier(str(tmp_path), budget=budget)
            stats = tier.stats()
            assert stats.extra["temps_removed"] == len(left) and not temp_files(tmp_path)
            assert stats.items == report.ok
            check_every_key(tier)
            assert tier.stats().extra["corrupt"] == 0
            tier.close()
    finally:
        server.kill()
        server.communicate()
    # The kills must have landed inside writes, or this test proved nothing.
    assert killed_mid_write >= 1, "no kill interrupted a write"
    tier = open_tier(str(tmp_path), budget=budget)
    assert check_every_key(tier) >= 1
    tier.close()
    print(f"\n{CRASH_ITERATIONS} kills, {killed_mid_write} mid-write, {temps_seen} temp files cleaned")


def test_a_new_process_reads_what_another_process_stored(tmp_path: Path) -> None:
    subprocess.run([sys.executable, WORKER, "store", str(tmp_path), "30"], check=True)
    tier = open_tier(str(tmp_path))
    stats = tier.stats()
    assert stats.items == 30
    assert stats.bytes_used == sum(len(value_of(i, 0)) for i in range(30))
    assert [bytes(v) for v in tier.get([key_of(i) for i in range(30)])] == [value_of(i, 0) for i in range(30)]
    assert tier.contains([key_of(30)]) == [False]
    tier.close()


def test_two_processes_share_a_folder_while_one_writes_and_evicts(tmp_path: Path) -> None:
    reader = open_tier(str(tmp_path), budget=10**9)  # opened while the folder is empty
    assert reader.stats().items == 0
    writer = start_writer(tmp_path, seed=7, writer="inline", budget=600_000)
    hits = misses = 0
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            seen = check_every_key(reader)
            hits += seen
            misses += KEYSPACE - seen
            present = reader.contains([key_of(i) for i in range(KEYSPACE)])
            assert sum(present) < KEYSPACE  # the writer's budget holds a fraction of the keys
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.communicate()
    stats = reader.stats()
    assert hits > 0 and misses > 0
    assert stats.errors == 0 and stats.extra["corrupt"] == 0
    assert stats.extra["discovered"] > 0 and stats.extra["vanished"] > 0
    reader.close()


@pytest.mark.parametrize("processes", [2, 4])
def test_the_budget_holds_for_the_folder_as_a_whole_across_processes(tmp_path: Path, processes: int) -> None:
    """Each process writes 1.25 budgets of its own keys into one folder at once. The
    folder, looked at after every put while its lock is held (no process between
    eviction and rename), never holds more than the budget, and ends using it (not
    emptied)."""
    budget, size, count = 8 * 1024**2, 256 * 1024, 40
    writers = [
        subprocess.Popen(
            [sys.executable, WORKER, "fill", str(tmp_path), str(seed), str(count), str(size), str(budget)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in range(processes)
    ]
    for writer in writers:
        assert writer.stdout.readline().strip() == "ready", writer.communicate()[1]  # type: ignore[union-attr]
    for writer in writers:
        writer.stdin.write("go\n")  # type: ignore[union-attr]
        writer.stdin.flush()  # type: ignore[union-attr]
    samples = []
    for writer in writers:
        out, err = writer.communicate(timeout=120)
        assert writer.returncode == 0, err
        lines = out.splitlines()
        assert lines[-1] == "done", out
        samples += [int(line.removeprefix("size ")) for line in lines if line.startswith("size ")]
    assert len(samples) == processes * count
    assert max(samples) <= budget, f"{max(samples)} bytes in the folder at once (budget {budget})"
    final = folder_value_bytes(tmp_path)
    assert budget - processes * size <= final <= budget
    tier = open_tier(str(tmp_path), budget=budget)
    assert tier.stats().extra["folder_bytes"] == final
    tier.close()


def test_lookups_answer_while_another_process_holds_the_folder_lock(tmp_path: Path) -> None:
    """Another process stopped while it holds the folder's lock (SIGSTOP, a debugger, a paused
    container, between its eviction and its rename): this process's writes wait for it (up to
    ``lock_wait_s``), its lookups and reads do not."""
    queued = open_tier(str(tmp_path), writer="background", budget=10**9, lock_wait_s=600)
    chain = queued.chain  # type: ignore[union-attr]
    tier = chain.tiers[0]
    chain.put([(key_of(0), value_of(0, 0))])
    chain.flush()
    holder = holding_the_folder_lock(tmp_path)
    answers: list[object] = []
    try:
        chain.put([(key_of(1), value_of(1, 0))])  # the write queue's thread waits for the lock
        deadline = time.monotonic() + 60
        while chain.stats()[0][1].extra["writer_pending"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the writer is inside its put, waiting for the folder's lock

        def look() -> None:
            answers.append(tier.contains([key_of(0), key_of(2)]))
            answers.append(bytes(tier.get([key_of(0)])[0]) == value_of(0, 0))

        reader = threading.Thread(target=look, daemon=True)
        reader.start()
        reader.join(30)
        assert answers == [[True, False], True], "a lookup waited for another process's lock on the folder"
    finally:
        holder.kill()
        holder.wait()
    chain.flush()  # the lock is free again: the write lands
    assert tier.contains([key_of(1)]) == [True]
    chain.close()
