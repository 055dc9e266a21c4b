"""A separate process using a disk tier, for the crash, restart and sharing tests.

    python disk_worker.py write-forever PATH SEED WRITER BUDGET   # prints "ready", writes until killed
    python disk_worker.py store PATH COUNT                         # stores COUNT keys, closes, exits
    python disk_worker.py fork-server PATH                         # see serve_forks
    python disk_worker.py fill PATH SEED COUNT SIZE BUDGET         # waits for "go" on stdin, stores COUNT new keys
                                                                   # and prints the folder's size after each put

The fork server imports everything once and forks one writer per stdin line, so
a crash test can kill many real writer processes without paying Python's start-up
for each.

Values are deterministic from (key index, version), so a reader can check every
byte: :func:`versions_of` gives each key's possible values.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import random
import subprocess
import sys
from pathlib import Path

from kvplug import TierChain
from kvplug.testing import key_for, tier_context, value_for
from kvplug_disk import DiskTier
from kvplug_disk.ledger import LEDGER_NAME

KEYSPACE = 40
VERSIONS = 3


def key_of(index: int) -> str:
    return key_for(f"k{index}")


def value_of(index: int, version: int) -> bytes:
    name = f"k{index}/v{version}"
    size = 1_000 + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") % 120_000
    return value_for(name, size)


def versions_of(index: int) -> set[bytes]:
    return {value_of(index, version) for version in range(VERSIONS)}


class Queued:
    """A disk tier written through the tier chain's write queue for it, as an engine writes it."""

    def __init__(self, tier: DiskTier) -> None:
        self.chain = TierChain([tier])

    def put(self, items: list[tuple[str, bytes]]) -> None:
        self.chain.put(items)

    def remove(self, keys: list[str]) -> None:
        self.chain.discard(keys)

    def close(self) -> None:
        self.chain.close()


def open_tier(
    path: str, *, writer: str = "inline", budget: int | None = None, lock_wait_s: float | None = None, **queue: object
) -> DiskTier | Queued:
    """WRITER ``inline``: the tier itself; ``background``: through the chain's write queue."""
    options: dict[str, object] = {"path": path, "fsync": queue.pop("fsync", True)}
    options["queue"] = {"mode": "sync" if writer == "inline" else "async", **queue}
    if budget is not None:
        options["max_bytes"] = budget
    if lock_wait_s is not None:
        options["lock_wait_s"] = lock_wait_s
    tier = DiskTier(DiskTier.Config(**options), tier_context())
    return tier if writer == "inline" else Queued(tier)


def write_forever(path: str, seed: int, writer: str, budget: int) -> None:
    # block: a producer faster than the disk waits, rather than dropping puts while removes run
    tier = open_tier(path, writer=writer, budget=budget, on_full="block", max_items=4)
    rng = random.Random(seed)
    print(f"ready {os.getpid()}", flush=True)
    while True:
        batch = [
            (key_of(i), value_of(i, rng.randrange(VERSIONS))) for i in rng.sample(range(KEYSPACE), rng.randint(1, 4))
        ]
        tier.put(batch)
        if rng.random() < 0.1:
            tier.remove([key_of(rng.randrange(KEYSPACE))])


def store(path: str, count: int) -> None:
    tier = open_tier(path, writer="background", on_full="block")
    for index in range(count):
        tier.put([(key_of(index), value_of(index, 0))])
    tier.close()  # queue.on_close: drain writes what is still queued


def fill(path: str, seed: int, count: int, size: int, budget: int) -> None:
    """Store ``count`` keys of its own (``size`` bytes each), one put each, then close.

    After each put it prints ``size BYTES``: the folder's value bytes, read while
    holding the lock every tier of the folder takes (so no process is between an
    eviction and a rename). That is one sample per put, taken while the other
    processes write, however fast the machine is."""
    tier = open_tier(path, writer="background", budget=budget, fsync=False, on_full="block", max_items=4)
    print("ready", flush=True)
    sys.stdin.readline()  # every process starts writing at once
    with (Path(path) / LEDGER_NAME).open("ab") as ledger:  # its own open file: flock excludes the tier's
        for index in range(count):
            name = f"fill{seed}/{index}"
            tier.put([(key_for(name), value_for(name, size))])
            fcntl.flock(ledger, fcntl.LOCK_EX)
            try:
                print(f"size {folder_value_bytes(Path(path))}", flush=True)
            finally:
                fcntl.flock(ledger, fcntl.LOCK_UN)
    tier.close()
    print("done", flush=True)


def folder_value_bytes(path: Path) -> int:
    """Value bytes of the record files in the folder now (each record has a 64-byte header)."""
    return sum(record.stat().st_size - 64 for record in path.glob("*/*.kvr"))


#: Holds a folder's lock (its usage file, argv[1]); argv[2]: "stop" (SIGSTOP: paused for ever) or seconds.
_HOLD_THE_FOLDER_LOCK = """
import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
if sys.argv[2] == "stop":
    os.kill(os.getpid(), signal.SIGSTOP)
else:
    time.sleep(float(sys.argv[2]))
"""


def holding_the_folder_lock(folder: Path, hold_s: float | None = None) -> subprocess.Popen[str]:
    """Another process, once it holds ``folder``'s lock (the one every tier of the folder takes):
    stopped while holding it (``hold_s`` None: a paused process, until killed), or holding it
    ``hold_s`` seconds. The caller kills or waits for it."""
    how = "stop" if hold_s is None else str(hold_s)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_THE_FOLDER_LOCK, str(folder / LEDGER_NAME), how], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None
    if holder.stdout.readline().strip() != "locked":
        holder.kill()
        holder.wait(30)
        raise AssertionError(f"the process meant to hold {folder}'s lock exited with {holder.returncode}")
    return holder


def serve_forks(path: str) -> None:
    """For each stdin line ``SEED WRITER BUDGET``: fork a writer (it prints ``ready PID``
    and writes until killed), wait for it to die, print ``dead SIGNAL``."""
    for line in sys.stdin:
        seed, writer, budget = line.split()
        pid = os.fork()  # this process runs no threads, so forking is safe
        if pid == 0:
            try:
                write_forever(path, int(seed), writer, int(budget))
            finally:
                os._exit(1)
        _, status = os.waitpid(pid, 0)
        print(f"dead {os.WTERMSIG(status) if os.WIFSIGNALED(status) else -1}", flush=True)


def main(argv: list[str]) -> None:
    command, path = argv[0], str(Path(argv[1]))
    if command == "write-forever":
        write_forever(path, int(argv[2]), argv[3], int(argv[4]))
    elif command == "fork-server":
        serve_forks(path)
    elif command == "store":
        store(path, int(argv[2]))
    elif command == "fill":
        fill(path, *(int(arg) for arg in argv[2:6]))  # type: ignore[call-arg]
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
