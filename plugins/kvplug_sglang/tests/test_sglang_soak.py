"""Nothing kvplug keeps per request outlives the request, in SGLang's tree cache run on and on.

The radix-cache backend, built by SGLang's own registry on a real (CPU) KV pool, serves rounds
of tiny requests the way the scheduler drives it (``sglang_soak.drive``): shared and fresh
prefixes, whole-prompt repeats, hits from the device tree and from kvplug, aborts in the
waiting queue, after a load-back and mid-run (a client gone mid-stream), preemption,
``/flush_cache``, a device pool small enough that SGLang evicts into kvplug, a cpu and a disk
tier that both evict, and disk records corrupted for real so some loads fail. After every round
the per-request state (load plans, tree locks, KV slots) is empty, long-lived state (the
identities of keys) is bounded, and threads and file descriptors are at their level after a
warm-up round.

The HiCache backend (``KVPlugStorage``) gets the same: rounds of page writes, lookups and
loads into a real host pool with corrupt records among them, ``clear`` (SGLang's flush of its
storage), and a detach and attach of the backend (SGLang's ``/hicache/storage-backend``): no
read in flight or given up, no host slot held, no thread or descriptor left by a closed backend.

Each soak runs in a process of its own (``sglang_soak_run.py``), which the levels are of.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from sglang_soak import POOLS
from sglang_soak_run import JOURNAL_WAITING, ROUNDS

HERE = Path(__file__).parent
#: Rounds before threads and fds are at their level.
WARM_UP = 2


def run_soak(folder: Path, which: str) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(HERE / "sglang_soak_run.py"), which, str(folder)],
        cwd=HERE,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def assert_nothing_kept(rounds: list[dict[str, Any]], name: str = "") -> None:
    """Per-request state empty after every round; threads and fds at the warm-up round's level
    (a pool's threads, which start as work comes, within its bound)."""
    assert len(rounds) == ROUNDS
    for number, round_ in enumerate(rounds):
        kept = {name: size for name, size in round_["sizes"].items() if size}
        assert not kept, f"{name} round {number}: state left after every request ended: {kept}"
    warm = steady(rounds[WARM_UP - 1]["level"])
    for number, round_ in enumerate(rounds[WARM_UP:], start=WARM_UP):
        level = steady(round_["level"])
        assert level == warm, f"{name} round {number}: threads or fds grew from {warm}: {level}"
        pooled = round_["level"]["python_threads"]
        assert all(pooled.get(name, 0) <= bound for name, bound in POOLS.items()), pooled


def assert_journal_bounded(rounds: list[dict[str, Any]], name: str = "") -> None:
    """The control journal keeps the keys some tier holds and at most ``JOURNAL_WAITING`` others
    (stores are sync: no write is in flight at a round's end). 202f2d0 kept every key it saw."""
    for number, round_ in enumerate(rounds):
        assert round_["journal"] <= round_["tiers_hold"] + JOURNAL_WAITING, (
            name,
            number,
            round_["journal"],
            round_["tiers_hold"],
        )


def steady(level: dict[str, Any]) -> tuple[dict[str, int], int, int]:
    """A round's threads by name and other threads (OpenMP's...) but the pools', and fds."""
    threads = {name: count for name, count in level["python_threads"].items() if name not in POOLS}
    pooled = sum(level["python_threads"].get(name, 0) for name in POOLS)
    return threads, level["tasks"] - pooled, level["fds"]


def test_radix_backend_keeps_nothing_per_request(tmp_path: Path) -> None:
    soaks = run_soak(tmp_path, "radix")
    assert sorted(soaks) == ["page_size=1", "page_size=4"]
    for name, done in soaks.items():
        counts = done["counts"]
        # the run went down the paths it is meant to: else a structure may be empty for want of use
        assert counts["aborted"] >= 3 * ROUNDS and counts["retracted"] >= ROUNDS and counts["loaded"] > 0, counts
        assert done["load_failures"] > 0, f"{name}: no load failed: the corrupted records were not read"
        assert all(done["evictions"]), f"{name}: a tier never evicted: {done['evictions']}"
        assert_nothing_kept(done["rounds"], name)
        assert all(round_["keys_of_adapters"] <= done["keys_limit"] for round_ in done["rounds"])
        assert_journal_bounded(done["rounds"], name)


def test_hicache_backend_keeps_nothing_per_page(tmp_path: Path) -> None:
    done = run_soak(tmp_path, "hicache")
    counts = done["counts"]
    assert counts["stored"] and counts["loaded"] and counts["missed"], counts
    assert all(done["evictions"]), f"a tier never evicted: {done['evictions']}"
    assert_nothing_kept(done["rounds"], "hicache")
    assert_journal_bounded(done["rounds"], "hicache")
