"""Tier ``mooncake`` next to Mooncake's raw client on the same cluster, in the same run.

Run by ``bench_tiers.py --sections mooncake`` (or alone), inside a network namespace
that has only loopback (Mooncake's binaries listen on the wildcard address)::

    unshare --net python benchmarks/bench_tiers.py --sections mooncake

Raw: ``batch_upsert_from`` / ``batch_get_into`` of the values, already in a registered
buffer (the least a put or get can cost). Tier: ``MooncakeTier.put`` / ``get`` of the
same values (record framing, checksums, deadlines, verified reads, copies out).
Goal: tier >= 90% of raw.
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import tempfile
import time
from pathlib import Path
from typing import Any


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvplug.testing import tier_context
    from kvplug_mooncake import MooncakeTier
    from kvplug_mooncake.testing import LoopbackOnlyError, MooncakeCluster, require_loopback_only_network

    try:
        require_loopback_only_network()
    except LoopbackOnlyError as exc:
        print(f"\nmooncake: skipped ({exc})")
        return {"skipped": str(exc)}
    total = min(args.total, 128 * 1024**2)
    workdir = Path(tempfile.mkdtemp(prefix="mooncake-", dir=args.dir))
    figures: dict[str, Any] = {}
    rows = []
    with MooncakeCluster(workdir, segment_size="1GB") as cluster:
        from mooncake.store import MooncakeDistributedStore

        raw = MooncakeDistributedStore()
        assert raw.setup(LOOPBACK, cluster.metadata_server, 0, 16 * 1024**2, "tcp", "", cluster.master_address) == 0
        tier = MooncakeTier(MooncakeTier.Config(**cluster.tier_options), tier_context())
        try:
            for size in args.sizes:
                rows += _one_size(raw, tier, size, total, args, figures)
        finally:
            tier.close()
            raw.close()
    _print_table(
        f"mooncake tier vs raw client (TCP on loopback, best of {args.repeats}, batch {args.batch})",
        ["values", "op", "raw GB/s", "tier GB/s", "tier/raw"],
        rows,
    )
    return figures


def _one_size(raw: Any, tier: Any, size: int, total: int, args: argparse.Namespace, figures: dict[str, Any]) -> list:
    """Raw and tier put/get of ``total`` bytes of ``size``-byte values; the table rows."""
    from kvplug.testing import key_for

    rows = []
    count = max(args.batch, total // size)
    values = [os.urandom(size) for _ in range(min(count, 4))]
    values = [values[i % len(values)] for i in range(count)]
    arena = mmap.mmap(-1, size * args.batch)
    address = ctypes.addressof(ctypes.c_char.from_buffer(arena))
    assert raw.register_buffer(address, len(arena)) == 0
    for i in range(args.batch):
        arena[i * size : (i + 1) * size] = values[i]
    raw_keys = [f"raw/{size}/{i}" for i in range(count)]
    tier_keys = [key_for(f"bench-{size}-{i}") for i in range(count)]
    batches = range(0, count, args.batch)
    pointers = [address + i * size for i in range(args.batch)]

    def raw_put() -> float:
        start = time.perf_counter()
        for b in batches:
            keys = raw_keys[b : b + args.batch]
            codes = raw.batch_upsert_from(keys, pointers[: len(keys)], [size] * len(keys))
            assert all(code == 0 for code in codes), codes
        return time.perf_counter() - start

    def raw_get() -> float:
        start = time.perf_counter()
        for b in batches:
            keys = raw_keys[b : b + args.batch]
            codes = raw.batch_get_into(keys, pointers[: len(keys)], [size] * len(keys))
            assert all(code == size for code in codes), codes
        return time.perf_counter() - start

    def tier_put() -> float:
        start = time.perf_counter()
        for b in batches:
            tier.put(list(zip(tier_keys[b : b + args.batch], values[b : b + args.batch])))
        return time.perf_counter() - start

    def tier_get() -> float:
        start = time.perf_counter()
        for b in batches:
            got = tier.get(tier_keys[b : b + args.batch])
            assert all(v is not None for v in got)
        return time.perf_counter() - start

    best = {name: float("inf") for name in ("raw_put", "tier_put", "raw_get", "tier_get")}
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        best["raw_put"] = min(best["raw_put"], raw_put())
        best["tier_put"] = min(best["tier_put"], tier_put())
        best["raw_get"] = min(best["raw_get"], raw_get())
        best["tier_get"] = min(best["tier_get"], tier_get())
    nbytes = count * size
    label = f"{count} x {size / 1024**2:.0f} MiB"
    for op in ("put", "get"):
        raw_s, tier_s = best[f"raw_{op}"], best[f"tier_{op}"]
        rows.append((label, op, _gbps(nbytes, raw_s), _gbps(nbytes, tier_s), f"{raw_s / tier_s:.0%}"))
        figures[f"{size // 1024**2}MiB_{op}"] = {
            "raw_gbps": round(_gbps(nbytes, raw_s), 3),
            "tier_gbps": round(_gbps(nbytes, tier_s), 3),
            "tier_over_raw": round(raw_s / tier_s, 3),
        }
    raw.batch_remove(raw_keys, True)
    tier.remove(tier_keys)
    raw.unregister_buffer(address)

    return rows


LOOPBACK = "127.0.0.1"


def _print_table(title: str, header: list[str], rows: list[tuple[Any, ...]]) -> None:
    print(f"\n{title}")
    cells = [header] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        print("  ".join(cell.rjust(width) for cell, width in zip(row, widths)))


if __name__ == "__main__":
    import json

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2,8", help="value sizes in MiB")
    parser.add_argument("--total", type=int, default=128, help="MiB per size")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    options.sizes = [int(s) * 1024**2 for s in options.sizes.split(",")]
    options.total *= 1024**2
    options.dir = None
    result = run(options)
    if options.json:
        print(json.dumps({"mooncake": result}))
