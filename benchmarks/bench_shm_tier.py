"""Section ``shm`` of bench_tiers.py: tier ``shm`` reads next to memcpy, in the same run.

    python benchmarks/bench_tiers.py --sections shm [--shm-dir /dev/shm] [--sizes 2MiB,8MiB]

Per value size, over ``--total`` bytes of distinct values (so no side reads from cache):

- ``memcpy``: copying the values from this process's memory into a destination buffer
  (the least a load from any tier costs: the scatter into the KV cache is such a copy);
- ``get``: ``tier.get`` alone, batches of ``--batch`` keys, the values held until the
  next batch as a caller holds them (shm: map + verify over the mapping; disk: read into
  fresh buffers + verify);
- ``get + copy``: ``get``, then each value copied into the destination: a load.

Rows of tier ``shm`` as configured by default: records mapped on a first read are kept
mapped, and the best of ``--repeats`` rounds is a round of reads from kept mappings (no
page faults, checksums verified on the first read). ``new mapping`` rows are tier
``shm`` with ``keep_mapped_bytes: 0``, so every read maps its record anew: what a process
pays the first time it reads a record (with the checksum; ``trust_host`` without it).

``ratio`` is memcpy's time over the row's time (goal for shm ``get + copy``: >= 0.7).
Tier ``disk`` pointed at the same tmpfs is measured alongside, for comparison.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench_tiers import print_table


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvplug_disk.mounts import file_system_of, huge_pages_of

    parent = Path(getattr(args, "shm_dir", None) or "/dev/shm")
    figures: dict[str, Any] = {"file_system": file_system_of(parent), "huge_pages": huge_pages_of(parent)}
    rows: list[tuple[Any, ...]] = []
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-shm-", dir=parent) as scratch:
        for size in args.sizes:
            measured = _measure(Path(scratch), size, args)
            figures[str(size)] = measured
            label = f"{size / 2**20:g} MiB x {measured['count']}"
            for what in (
                "memcpy",
                "shm get",
                "shm get + copy",
                "shm new mapping get",
                "shm new mapping get + copy",
                "shm new mapping trust_host get",
                "shm new mapping trust_host get + copy",
                "disk get",
                "disk get + copy",
            ):
                gbps = measured[what]
                rows.append((label, what, gbps, gbps / measured["memcpy"]))
    print_table(
        f"tier shm vs memcpy in {parent} ({figures['file_system']}, huge pages {figures['huge_pages']}; "
        f"best of {args.repeats}; "
        f"{args.batch} values per get; disk: tier disk on the same folder's file system)",
        ["values", "op", "GB/s", "vs memcpy"],
        [(*row[:3], f"{row[3]:.0%}") for row in rows],
    )
    return figures


def _measure(scratch: Path, size: int, args: argparse.Namespace) -> dict[str, Any]:
    from kvplug.testing import key_for, tier_context
    from kvplug_disk import DiskTier, ShmTier

    count = max(4, args.total // size)
    seed = bytes(range(256)) * (size // 256 + 1)
    values = [bytes([i % 251]) + seed[i % 256 : i % 256 + size - 1] for i in range(count)]  # distinct
    keys = [key_for(f"bench-shm-{size}-{i}") for i in range(count)]
    destination = memoryview(bytearray(size))  # the KV cache a load scatters into: faulted in once
    destination[:] = values[0]
    gb = count * size / 1e9

    def copy_all(buffers: Sequence[Any]) -> None:
        for value in buffers:
            destination[:] = value

    def memcpy() -> float:
        started = time.perf_counter()
        copy_all(values)
        return time.perf_counter() - started

    def reads(tier: Any, then_copy: bool) -> Callable[[], float]:
        def timed() -> float:
            started = time.perf_counter()
            for at in range(0, count, args.batch):
                got = tier.get(keys[at : at + args.batch])
                if then_copy:
                    copy_all(got)
            elapsed = time.perf_counter() - started
            assert all(v is not None for v in got), "tier lost values"
            return elapsed

        return timed

    tiers = {}
    kinds: list[tuple[str, Any, dict[str, Any]]] = [
        ("shm", ShmTier, {}),
        ("shm new mapping", ShmTier, {"keep_mapped_bytes": 0}),
        ("shm new mapping trust_host", ShmTier, {"keep_mapped_bytes": 0, "trust_host": True}),
        ("disk", DiskTier, {}),
    ]
    for index, (name, cls, extra) in enumerate(kinds):
        options: dict[str, Any] = {"path": scratch / f"{index}-{size}", "max_bytes": 2 * count * size, "fsync": False}
        tier = cls(cls.Config(**options, **extra), tier_context())
        for at in range(0, count, args.batch):
            tier.put(list(zip(keys[at : at + args.batch], values[at : at + args.batch])))
        tier.flush()
        tiers[name] = tier
    runs: dict[str, Callable[[], float]] = {"memcpy": memcpy}
    for name, tier in tiers.items():
        runs[f"{name} get"] = reads(tier, then_copy=False)
        runs[f"{name} get + copy"] = reads(tier, then_copy=True)
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.repeats):  # interleaved, so that a noisy neighbour hits every row alike
        for what, timed in runs.items():
            best[what] = min(best[what], timed())
    for index, tier in enumerate(tiers.values()):
        tier.close()
        shutil.rmtree(scratch / f"{index}-{size}", ignore_errors=True)
    return {"count": count, **{what: round(gb / seconds, 4) for what, seconds in best.items()}}
