"""The cost of opening a shared folder: tier ``disk`` (and ``shm``) rebuilding its index from
a listing, next to a bare listing of the same folder measured in the same run.

    python benchmarks/bench_folder_open.py                         # 10k and 100k records, /tmp and /dev/shm
    python benchmarks/bench_folder_open.py --records 10000 --kinds disk --json   # one JSON line on stdout

Per kind (``disk`` in a scratch folder under ``--dir``, ``shm`` under ``--shm-dir``) and record
count, the tier itself fills a folder with small records (``--value`` bytes), a third of them of a
salted tenant (tagged ``user.kvplug.tenant``), written by a tier with a quota for that tenant, so
the folder's ledger keeps a tenant table. Then, dentries and inodes cached, best of ``--repeats``
rounds, interleaved:

- ``bare``: ``os.scandir`` of every shard folder and an ``lstat`` per entry: the least any
  rebuild must do (the baseline);
- ``open``: the tier opened on the folder, index rebuilt (a ledger with a tenant table: each
  record's tag is read to rebuild it); ``open, quotas``: the same with a quota configured;
  ``open, no table``: the ledger holds the total alone and no quota is configured (no tags read);
- ``re-list``: an open tier's next put, after the ledger's total was raised past what the
  process knows (as another process's records, or a crash, leave it): the folder is listed again
  under the folder's lock before the record is written.

``vs bare`` is the row's time over the baseline's (lower is better). Results are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_tiers import print_table

TENANT = "tenant-a"
#: Far above what the benchmark stores: nothing is evicted, by budget or quota.
BIG = 1 << 40


def _tier_type(kind: str) -> Any:
    from kvplug_disk import DiskTier, ShmTier

    return ShmTier if kind == "shm" else DiskTier


def _open(kind: str, folder: Path, **options: Any) -> Any:
    from kvplug.testing.pins_contract import pins_context

    tier_type = _tier_type(kind)
    config = tier_type.Config(path=folder, fsync=False, max_bytes=options.pop("max_bytes", BIG), **options)
    return tier_type(config, pins_context())


def _key(i: int) -> str:
    from kvplug.testing.pins_contract import key_of

    return key_of(TENANT if i % 3 == 0 else None, f"listing-{i}")


def _fill(kind: str, folder: Path, count: int, value: bytes) -> float:
    tier = _open(kind, folder, quotas={TENANT: BIG})
    started = time.perf_counter()
    for at in range(0, count, 1000):
        tier.put([(_key(i), value) for i in range(at, min(at + 1000, count))])
    tier.flush()
    elapsed = time.perf_counter() - started
    tier.close()
    return elapsed


def _ledger(folder: Path, *, table: bool | None = None, raise_by: int = 0) -> tuple[int, bool]:
    """The ledger's total and whether it holds a tenant table; rewritten without its table
    (``table=False``) or with its total raised by ``raise_by`` (the table kept, valid)."""
    from kvplug_disk.ledger import LEDGER_NAME
    from kvplug_disk.tenant_tags import decode_usage, encode_usage

    path = folder / LEDGER_NAME
    total, tenants = decode_usage(path.read_bytes())
    assert total is not None, "the folder's ledger holds no total"
    if table is False:
        tenants = None
    if table is False or raise_by:
        total += raise_by
        path.write_bytes(encode_usage(total, tenants))
    return total, tenants is not None


def _bare(folder: Path, count: int) -> Callable[[], float]:
    def timed() -> float:
        started = time.perf_counter()
        found = 0
        with os.scandir(folder) as shards:
            for shard in shards:
                if shard.is_dir(follow_symlinks=False):
                    with os.scandir(shard.path) as entries:
                        for entry in entries:
                            entry.stat(follow_symlinks=False)
                            found += 1
        elapsed = time.perf_counter() - started
        assert found == count, found
        return elapsed

    return timed


def _opening(kind: str, folder: Path, count: int, *, table: bool, **options: Any) -> Callable[[], float]:
    def timed() -> float:
        if not table:
            _ledger(folder, table=False)
        started = time.perf_counter()
        tier = _open(kind, folder, **options)
        elapsed = time.perf_counter() - started
        assert tier.stats().items == count, tier.stats().items
        tier.close()
        assert _ledger(folder)[1] == table, "the ledger's tenant table is not as this row says"
        return elapsed

    return timed


def _relisting(kind: str, folder: Path, count: int, value: bytes) -> Callable[[], float]:
    """A put that lists the folder again: the ledger's total raised past the budget less what
    this process knows. The put's record file is unlinked after (the next open's listing
    corrects the ledger), so every round and row finds the same folder."""
    from kvplug import key_digest
    from kvplug_disk.folder_scan import RECORD_SUFFIX

    key = _key(count)  # a new record, of no tenant
    digest = key_digest(key).hex()
    path = folder / digest[:2] / f"{digest}{RECORD_SUFFIX}"

    def timed() -> float:
        total, _ = _ledger(folder)
        budget = 2 * total + (1 << 20)
        tier = _open(kind, folder, max_bytes=budget)
        _ledger(folder, raise_by=budget)  # the table kept: the listing reads the tags as at open
        started = time.perf_counter()
        tier.put([(key, value)])
        elapsed = time.perf_counter() - started
        assert _ledger(folder)[0] < budget, "the put did not list the folder again"
        assert tier.stats().items == count + 1, tier.stats().items
        tier.close()
        path.unlink()
        return elapsed

    return timed


def measure(kind: str, parent: Path, count: int, args: argparse.Namespace) -> dict[str, Any]:
    from kvplug_disk.mounts import file_system_of

    value = b"v" * args.value
    folder = parent / f"{kind}-{count}"
    fill_s = _fill(kind, folder, count, value)
    runs = {
        "bare": _bare(folder, count),
        "open": _opening(kind, folder, count, table=True),
        "open, quotas": _opening(kind, folder, count, table=True, quotas={TENANT: BIG}),
        "re-list": _relisting(kind, folder, count, value),
    }
    best = dict.fromkeys([*runs, "open, no table"], float("inf"))
    for _ in range(args.repeats):  # interleaved, so that a noisy neighbour hits every row alike
        for what in ("bare", "open, quotas", "open", "re-list"):
            best[what] = min(best[what], runs[what]())
        best["open, no table"] = min(best["open, no table"], _opening(kind, folder, count, table=False)())
        # The table back for the next round (an open with a quota rebuilds it from the tags).
        _opening(kind, folder, count, table=True, quotas={TENANT: BIG})()
    file_system = file_system_of(folder)
    shutil.rmtree(folder)
    bare = best["bare"]
    return {
        "records": count,
        "file_system": file_system,
        "fill_s": round(fill_s, 2),
        **{what: {"s": round(s, 4), "vs_bare": round(s / bare, 2)} for what, s in best.items()},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the disk scratch folder (default: /tmp)")
    parser.add_argument("--shm-dir", type=Path, default=Path("/dev/shm"), help="parent of the shm scratch folder")
    parser.add_argument("--records", default="10000,100000", help="record counts, comma-separated")
    parser.add_argument("--kinds", default="disk,shm", help="tiers: disk, shm")
    parser.add_argument("--value", type=int, default=64, help="bytes of each record's value")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="tables on stderr; one JSON object as stdout's last line")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.records.split(",") if n.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    stdout = sys.stdout
    figures: dict[str, Any] = {"benchmark": "bench_folder_open", "value_bytes": args.value, "repeats": args.repeats}
    if args.json:
        sys.stdout = sys.stderr  # the tables; stdout keeps the JSON line
    try:
        for kind in kinds:
            parent = args.shm_dir if kind == "shm" else args.dir
            with tempfile.TemporaryDirectory(prefix="kvplug-bench-open-", dir=parent) as scratch:
                for count in counts:
                    need = count * (4096 + args.value) * 2  # a block (a page on tmpfs) a record, and slack
                    free = shutil.disk_usage(scratch).free
                    if free < need:
                        print(f"\ntier {kind}: {count} records skipped: {scratch} has {free >> 20} MiB free")
                        figures.setdefault(kind, {})[str(count)] = {"skipped": f"{free} bytes free"}
                        continue
                    measured = figures.setdefault(kind, {})[str(count)] = measure(kind, Path(scratch), count, args)
                    rows = [
                        (what, f"{s:.3f}", f"{s / count * 1e6:.1f}", f"{measured[what]['vs_bare']:.2f}x")
                        for what in ("bare", "open", "open, quotas", "open, no table", "re-list")
                        for s in [measured[what]["s"]]
                    ]
                    print_table(
                        f"tier {kind}: opening a folder of {count} records ({measured['file_system']}, "
                        f"{args.value}-byte values, a third tagged; filled in {measured['fill_s']} s; "
                        f"best of {args.repeats})",
                        ["what", "seconds", "us per record", "vs bare"],
                        rows,
                    )
    finally:
        sys.stdout = stdout
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
