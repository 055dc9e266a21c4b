"""Tier ``s3`` put/get GB/s next to raw s3fs on the same local S3 server, same run.

    python benchmarks/bench_s3_tier.py                          # moto on 127.0.0.1, default sizes
    python benchmarks/bench_s3_tier.py --sizes 1MiB,8MiB --total 128MiB --batch 16
    python benchmarks/bench_s3_tier.py --endpoint http://127.0.0.1:9000 --bucket kv   # MinIO etc.

For each value size it writes ``total`` bytes in batches of ``batch`` values, then
reads them back, twice over: through ``S3Tier.put``/``get`` (record frame,
checksum verification, deadlines, breaker) and through raw s3fs ``fs.pipe`` /
``fs.cat`` of the same values batched the same way, alternating the two so drift
hits both. The server runs in a subprocess, so it does not share the client's GIL.
Goal: the tier at >= 90% of raw s3fs. Results are printed, never asserted.

``run(sizes, total_bytes)`` returns one dict per size; ``run(args)`` with the
namespace of ``benchmarks/bench_tiers.py`` also prints the table.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

ACCESS_KEY, SECRET_KEY = "bench-key", "bench-secret"
CONCURRENCY = 16


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server in a subprocess on 127.0.0.1 and a free port; yields its endpoint."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def _raw_fs(endpoint: str) -> Any:
    import s3fs

    # The same connection settings the tier gives s3fs, so only the tier's own work differs.
    return s3fs.S3FileSystem(
        endpoint_url=endpoint,
        key=ACCESS_KEY,
        secret=SECRET_KEY,
        skip_instance_cache=True,
        use_listings_cache=False,
        config_kwargs={"max_pool_connections": CONCURRENCY, "retries": {"total_max_attempts": 1}},
        client_kwargs={"region_name": "us-east-1"},
    )


def _tier(endpoint: str, bucket: str, prefix: str) -> Any:
    from kvplug.testing import tier_context
    from kvplug_s3 import S3Tier

    config = S3Tier.Config(
        url=f"s3://{bucket}/{prefix}",
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET_KEY,
        max_concurrency=CONCURRENCY,
        scan_on_start=False,
    )
    return S3Tier(config, tier_context())


def _timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def measure_size(endpoint: str, bucket: str, size: int, total_bytes: int, batch: int, repeats: int) -> dict[str, Any]:
    """Put/get GB/s of tier and raw s3fs for ``total_bytes`` in values of ``size``."""
    from kvplug.testing import key_for

    count = max(1, total_bytes // size)
    values = [os.urandom(size) for _ in range(min(count, 8))]  # few distinct buffers keep memory flat
    keys = [key_for(f"bench-{size}-{i}") for i in range(count)]
    batches = [list(range(start, min(start + batch, count))) for start in range(0, count, batch)]
    raw = _raw_fs(endpoint)
    times: dict[str, list[float]] = {"put": [], "get": [], "raw_put": [], "raw_get": []}
    for repeat in range(repeats):
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        tier = _tier(endpoint, bucket, f"{prefix}/tier")
        paths = [f"{bucket}/{prefix}/raw/{i}" for i in range(count)]

        def raw_put(part: list[int]) -> None:
            raw.pipe({paths[i]: values[i % len(values)] for i in part})

        def raw_get(part: list[int]) -> None:
            got = raw.cat([paths[i] for i in part])
            assert all(len(v) == size for v in got.values())

        def tier_put(part: list[int]) -> None:
            tier.put([(keys[i], values[i % len(values)]) for i in part])

        def tier_get(part: list[int]) -> None:
            got = tier.get([keys[i] for i in part])
            assert all(v is not None and len(v) == size for v in got)

        # moto's speed drifts (with load, with how many objects it holds): the two
        # sides take turns batch by batch, who goes first alternating, so drift hits both.
        for phase, pair in (("put", (raw_put, tier_put)), ("get", (raw_get, tier_get))):
            spent = {"raw": 0.0, "tier": 0.0}
            for number, part in enumerate(batches):
                order = [("raw", pair[0]), ("tier", pair[1])]
                for side, action in order if (number + repeat) % 2 == 0 else order[::-1]:
                    spent[side] += _timed(functools.partial(action, part))
            times[f"raw_{phase}"].append(spent["raw"])
            times[phase].append(spent["tier"])
        raw.rm(f"{bucket}/{prefix}", recursive=True)
        assert tier.stats().extra["dropped_puts"] == 0
        tier.close()
    # Totals over every repeat: steadier than a median of few samples on a busy machine.
    moved = repeats * count * size / 1e9
    rate = {name: moved / sum(seconds) for name, seconds in times.items()}
    return {
        "tier": "s3",
        "size": size,
        "count": count,
        "batch": batch,
        "put_gbps": rate["put"],
        "raw_put_gbps": rate["raw_put"],
        "put_ratio": rate["put"] / rate["raw_put"],
        "get_gbps": rate["get"],
        "raw_get_gbps": rate["raw_get"],
        "get_ratio": rate["get"] / rate["raw_get"],
    }


def run(
    sizes: Any,
    total_bytes: int | None = None,
    *,
    batch: int = 8,
    repeats: int = 4,
    endpoint: str | None = None,
    bucket: str = "kvplug-bench",
) -> list[dict[str, Any]]:
    """One result dict per value size. ``sizes`` may also be the argparse namespace
    of ``bench_tiers.py`` (sizes, total, batch, repeats); then the table is printed."""
    printing = isinstance(sizes, argparse.Namespace)
    if printing:
        args = sizes
        sizes, total_bytes = args.sizes, args.total
        batch, repeats = getattr(args, "batch", batch), getattr(args, "repeats", repeats)
    if total_bytes is None:
        raise TypeError("run() needs total_bytes")
    with contextlib.ExitStack() as stack:
        if endpoint is None:
            endpoint = stack.enter_context(moto_server())
        fs = _raw_fs(endpoint)
        if not fs.exists(bucket):
            fs.call_s3("create_bucket", Bucket=bucket)  # us-east-1: no location constraint
        rows = [measure_size(endpoint, bucket, size, total_bytes, batch, repeats) for size in sizes]
    if printing:
        print_rows(rows, endpoint)
    return rows


def print_rows(rows: list[dict[str, Any]], where: str) -> None:
    print(f"\ns3 tier vs raw s3fs ({where}, batch of {rows[0]['batch'] if rows else '?'}, GB/s over all repeats)")
    header = ("size", "n", "tier put", "s3fs pipe", "ratio", "tier get", "s3fs cat", "ratio")
    lines = [header] + [
        (
            f"{r['size'] / 2**20:g} MiB", str(r["count"]),
            f"{r['put_gbps']:.3f}", f"{r['raw_put_gbps']:.3f}", f"{r['put_ratio']:.0%}",
            f"{r['get_gbps']:.3f}", f"{r['raw_get_gbps']:.3f}", f"{r['get_ratio']:.0%}",
        )  # fmt: skip
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths)))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _size(text: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256KiB,1MiB,4MiB,16MiB", help="value sizes, comma-separated")
    parser.add_argument("--total", default="256MiB", help="bytes written per size and repeat")
    parser.add_argument("--batch", type=int, default=8, help="values per put/get call (and per pipe/cat call)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of starting moto")
    parser.add_argument("--bucket", default="kvplug-bench")
    args = parser.parse_args()
    if args.endpoint:  # credentials for an endpoint of your own come from the environment
        global ACCESS_KEY, SECRET_KEY
        ACCESS_KEY = os.environ.get("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        SECRET_KEY = os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    rows = run(
        [_size(s) for s in args.sizes.split(",")],
        _size(args.total),
        batch=args.batch,
        repeats=args.repeats,
        endpoint=args.endpoint,
        bucket=args.bucket,
    )
    print_rows(rows, args.endpoint or "moto on 127.0.0.1")


if __name__ == "__main__":
    main()
