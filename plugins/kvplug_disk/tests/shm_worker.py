"""Separate processes using tier ``shm``, for its multi-process tests.

    python shm_worker.py fork-server PATH BUDGET   # per stdin line SEED: forks a churner (see churn)
    python shm_worker.py replace PATH PUT REMOVE   # stores version 1 of key PUT, removes key REMOVE, exits

Keys and values are disk_worker's: deterministic from (key index, version), so any
process can check every byte it reads.
"""

from __future__ import annotations

import os
import random
import signal
import sys

from disk_worker import KEYSPACE, VERSIONS, key_of, value_of

from kvplug.testing import tier_context
from kvplug_disk import ShmTier


def open_shm(path: str, budget: int | None = None) -> ShmTier:
    options: dict[str, object] = {"path": path, "queue": {"mode": "sync"}}
    if budget is not None:
        options["max_bytes"] = budget
    return ShmTier(ShmTier.Config(**options), tier_context())


def churn(path: str, seed: int, budget: int, versions: dict[int, set[bytes]]) -> None:
    """Print ``ready PID``, then until killed: put 1-3 keys (random versions), get 1-4
    keys and check every byte of each hit, now and then remove one. A hit that is not
    one of its key's values is printed to stderr as ``bad KEY``."""
    tier = open_shm(path, budget)
    rng = random.Random(seed)
    print(f"ready {os.getpid()}", flush=True)
    while True:
        picked = rng.sample(range(KEYSPACE), rng.randint(1, 3))
        tier.put([(key_of(i), value_of(i, rng.randrange(VERSIONS))) for i in picked])
        wanted = rng.sample(range(KEYSPACE), rng.randint(1, 4))
        for index, value in zip(wanted, tier.get([key_of(i) for i in wanted])):
            if value is not None and bytes(value) not in versions[index]:
                print(f"bad {index} {len(value)}", file=sys.stderr, flush=True)
        if rng.random() < 0.1:
            tier.remove([key_of(rng.randrange(KEYSPACE))])


def serve_forks(path: str, budget: int) -> None:
    """Fork one churner per stdin line ``SEED``, several at once; each prints ``ready PID``.
    Children are reaped by the kernel (SIGCHLD ignored), so a killed one's pid is gone
    as soon as it is dead."""
    versions = {i: {value_of(i, v) for v in range(VERSIONS)} for i in range(KEYSPACE)}  # once, shared by fork
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    for line in sys.stdin:
        pid = os.fork()  # this process runs no threads, so forking is safe
        if pid == 0:
            try:
                churn(path, int(line), budget, versions)
            finally:
                os._exit(1)


def replace(path: str, put: int, remove: int) -> None:
    tier = open_shm(path)
    tier.put([(key_of(put), value_of(put, 1))])
    tier.remove([key_of(remove)])
    tier.close()


def main(argv: list[str]) -> None:
    command, path = argv[0], argv[1]
    if command == "fork-server":
        serve_forks(path, int(argv[2]))
    elif command == "replace":
        replace(path, int(argv[2]), int(argv[3]))
    else:
        raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
