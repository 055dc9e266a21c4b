"""Storage tier throughput against the raw I/O underneath it, measured in the same run.

    python benchmarks/bench_tiers.py                       # every section, temp dir under /tmp
    python benchmarks/bench_tiers.py --dir /mnt/nvme/tmp --sizes 2MiB,8MiB,32MiB --total 512MiB
    python benchmarks/bench_tiers.py --sections disk,s3 --json   # tables on stderr, one JSON line on stdout

Sections (``SECTIONS``): each is one function ``run_<name>(args) -> dict`` that prints
its own table and returns its figures (ratios included); ``--json`` prints every
section's figures as one JSON object, the last line of stdout.

- ``disk``: tier ``disk`` write and read GB/s next to raw ``write + fdatasync + rename``
  and raw ``open + read`` of the same values in the same folder; reads both hot (page
  cache) and cold (pages dropped with posix_fadvise DONTNEED, file by file, so no
  global cache drop is needed). Goal: tier >= 90% of raw at 8 MiB.
- ``shm``: tier ``shm`` get (records mapped, verified over the mapping) and get + copy
  into a destination, next to memcpy of the same bytes, and tier ``disk`` on the same
  tmpfs, in a scratch folder under ``--shm-dir`` (``benchmarks/bench_shm_tier.py``).
  Goal: shm get + copy >= 70% of memcpy.
- ``startup``: a disk tier's index rebuild over ``--index-files`` small records,
  next to a bare scandir + stat of the same tree (the least any rebuild must do).
- Remote stores, each next to its raw client on the same server in the same run, put
  and get per value size; goal: tier >= 90% of raw. A remote store's section lives in
  ``benchmarks/bench_<store>_tier.py`` as ``run(args) -> dict`` and is listed in
  ``REMOTE_SECTIONS``: ``s3`` (s3fs on moto and on SeaweedFS; ``--servers``),
  ``valkey``, ``mooncake``. A section whose file is missing is reported and skipped.

Results are printed, never asserted.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import ByteSize, TypeAdapter

_fdatasync = getattr(os, "fdatasync", os.fsync)


# --- table ---------------------------------------------------------------------------


def print_table(title: str, header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [list(map(str, header))] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    print(f"\n{title}")
    for n, row in enumerate(cells):
        print("  " + "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))))
        if n == 0:
            print("  " + "  ".join("-" * w for w in widths))


def _cell(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def best_of(repeats: int, run: Callable[[], float]) -> float:
    """The fastest of ``repeats`` timed runs (seconds): the least disturbed by neighbours."""
    return min(run() for _ in range(repeats))


def parse_size(text: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(text))


# --- disk ----------------------------------------------------------------------------


def _raw_write(folder: Path, values: Sequence[bytes]) -> float:
    shutil.rmtree(folder, ignore_errors=True)  # start empty, like the tier: no old inode to free on rename
    folder.mkdir()
    started = time.perf_counter()
    for i, value in enumerate(values):
        final = f"{folder}/{i:06d}.raw"
        temp = final + ".tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        view = memoryview(value)
        while view:
            view = view[os.write(fd, view) :]
        _fdatasync(fd)
        os.close(fd)
        os.replace(temp, final)
    return time.perf_counter() - started


def _raw_read(folder: Path, count: int, batch: int) -> float:
    """Reads into fresh buffers held a batch at a time, as a tier's caller holds what
    ``get`` returned: both sides pay for faulting in new memory alike."""
    started = time.perf_counter()
    held: list[bytes] = []
    for i in range(count):
        if len(held) == batch:
            held = []
        fd = os.open(f"{folder}/{i:06d}.raw", os.O_RDONLY)
        size = os.fstat(fd).st_size
        data = os.read(fd, size)
        while len(data) < size:
            data += os.read(fd, size - len(data))
        os.close(fd)
        held.append(data)
    return time.perf_counter() - started


def _drop_pages(folder: Path) -> None:
    """Evict one folder's (already synced) files from the page cache."""
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def run_disk(args: argparse.Namespace) -> dict[str, Any]:
    rows = [row for size in args.sizes for row in _measure_disk(args, size)]
    print_table(
        f"disk tier vs raw files in {args.dir} (best of {args.repeats}; write = write+fdatasync+rename; "
        f"tier batches {args.batch} values per put, through the chain's write queue, flush included)",
        ["values", "op", "raw GB/s", "tier GB/s", "tier/raw"],
        [(*row[:4], f"{row[4]:.0%}") for row in rows],
    )
    figures: dict[str, Any] = {}
    for (_, op, raw, tier, ratio), size in zip(rows, [s for s in args.sizes for _ in range(3)]):
        figures.setdefault(str(size), {})[op] = {
            "raw_gbps": round(raw, 4),
            "tier_gbps": round(tier, 4),
            "ratio": round(ratio, 4),
        }
    return figures


def _measure_disk(args: argparse.Namespace, size: int) -> list[tuple[Any, ...]]:
    from kvplug import TierChain
    from kvplug.testing import key_for, tier_context
    from kvplug_disk import DiskTier

    count = max(4, args.total // size)
    distinct = [os.urandom(size) for _ in range(min(count, 4))]
    values = [distinct[i % len(distinct)] for i in range(count)]
    keys = [key_for(f"bench-{size}-{i}") for i in range(count)]
    gb = count * size / 1e9
    raw_dir = args.dir / f"raw-{size}"
    tier_dir = args.dir / f"tier-{size}"

    def tier_write() -> float:
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = DiskTier(
            DiskTier.Config(path=tier_dir, max_bytes=2 * count * size, queue={"on_full": "block"}), tier_context()
        )
        chain = TierChain([tier])  # written as an engine writes it: through the chain's write queue
        started = time.perf_counter()
        for at in range(0, count, args.batch):  # an engine stores a request's chunks as one batch
            chain.put(list(zip(keys[at : at + args.batch], values[at : at + args.batch])))
        chain.flush()
        elapsed = time.perf_counter() - started
        chain.close()
        return elapsed

    def tier_read() -> float:
        tier = DiskTier(DiskTier.Config(path=tier_dir, max_bytes=2 * count * size), tier_context())
        started = time.perf_counter()
        for at in range(0, count, args.batch):
            got = tier.get(keys[at : at + args.batch])
            assert all(v is not None for v in got), "tier lost values"
        elapsed = time.perf_counter() - started
        tier.close()
        return elapsed

    # Interleaved so that drifting disk speed hits both sides alike.
    raw_w = tier_w = float("inf")
    for _ in range(args.repeats):
        raw_w = min(raw_w, _raw_write(raw_dir, values))
        tier_w = min(tier_w, tier_write())
    raw_hot = tier_hot = raw_cold = tier_cold = float("inf")
    for _ in range(args.repeats):
        raw_hot = min(raw_hot, _raw_read(raw_dir, count, args.batch))
        tier_hot = min(tier_hot, tier_read())
    for _ in range(args.repeats):
        _drop_pages(raw_dir)
        raw_cold = min(raw_cold, _raw_read(raw_dir, count, args.batch))
        _drop_pages(tier_dir)
        tier_cold = min(tier_cold, tier_read())
    shutil.rmtree(raw_dir)
    shutil.rmtree(tier_dir)
    label = f"{size / 2**20:g} MiB x {count}"
    return [
        (label, "write", gb / raw_w, gb / tier_w, raw_w / tier_w),
        (label, "read (page cache)", gb / raw_hot, gb / tier_hot, raw_hot / tier_hot),
        (label, "read (cold)", gb / raw_cold, gb / tier_cold, raw_cold / tier_cold),
    ]


# --- startup -------------------------------------------------------------------------


def run_startup(args: argparse.Namespace) -> dict[str, Any]:
    from kvplug.testing import key_for, tier_context
    from kvplug_disk import DiskTier

    folder = args.dir / "index"
    filler = DiskTier(DiskTier.Config(path=folder, fsync=False), tier_context())
    started = time.perf_counter()
    for at in range(0, args.index_files, 1000):
        filler.put([(key_for(f"idx-{i}"), b"x" * 64) for i in range(at, min(at + 1000, args.index_files))])
    fill_s = time.perf_counter() - started
    filler.close()

    def bare_scan() -> float:
        started = time.perf_counter()
        found = 0
        for shard in os.scandir(folder):
            if shard.is_dir():
                with os.scandir(shard.path) as entries:
                    for entry in entries:
                        entry.stat()
                        found += 1
        assert found == args.index_files, found
        return time.perf_counter() - started

    def tier_start() -> float:
        started = time.perf_counter()
        tier = DiskTier(DiskTier.Config(path=folder), tier_context())
        elapsed = time.perf_counter() - started
        assert tier.stats().items == args.index_files
        tier.close()
        return elapsed

    scan_s = best_of(args.repeats, bare_scan)
    start_s = best_of(args.repeats, tier_start)
    print_table(
        f"disk tier start-up (index rebuild) over {args.index_files} records, dentries cached "
        f"(filled in {fill_s:.1f} s without fsync)",
        ["what", "seconds", "us per file", "vs bare scan"],
        [
            ("bare scandir + stat", scan_s, scan_s / args.index_files * 1e6, "100%"),
            ("DiskTier(...) start", start_s, start_s / args.index_files * 1e6, f"{scan_s / start_s:.0%}"),
        ],
    )
    shutil.rmtree(folder)
    return {
        "files": args.index_files,
        "bare_scan_s": round(scan_s, 4),
        "tier_start_s": round(start_s, 4),
        "ratio": round(scan_s / start_s, 4),
    }


# --- remote stores: one module each ---------------------------------------------------

#: Section name -> module in benchmarks/ with ``run(args) -> dict`` (prints its own table).
REMOTE_SECTIONS = {"s3": "bench_s3_tier", "valkey": "bench_valkey_tier", "mooncake": "bench_mooncake_tier"}
MODULE_SECTIONS = {"shm": "bench_shm_tier", **REMOTE_SECTIONS}


def run_remote(name: str, args: argparse.Namespace) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    module_name = MODULE_SECTIONS[name]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        print(f"\n{name}: benchmarks/{module_name}.py is not there; skipped")
        return {"skipped": f"benchmarks/{module_name}.py is missing"}
    return module.run(args) or {}


def _remote_section(name: str) -> Callable[[argparse.Namespace], dict[str, Any]]:
    return lambda args: run_remote(name, args)


SECTIONS: dict[str, Callable[[argparse.Namespace], dict[str, Any]]] = {
    "disk": run_disk,
    "startup": run_startup,
    **{name: _remote_section(name) for name in MODULE_SECTIONS},
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=None, help="parent of the scratch folder (default: /tmp)")
    parser.add_argument("--sizes", default="2MiB,8MiB", help="value sizes, comma-separated")
    parser.add_argument("--total", default="256MiB", help="bytes written per size")
    parser.add_argument("--batch", type=int, default=8, help="values per tier put/get call")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--index-files", type=int, default=100_000)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"of {', '.join(SECTIONS)}")
    parser.add_argument("--shm-dir", default="/dev/shm", help="shm section: parent of its scratch folder")
    parser.add_argument("--servers", default="moto,seaweedfs", help="s3 section: S3 servers to start")
    parser.add_argument("--json", action="store_true", help="tables on stderr; one JSON object as stdout's last line")
    args = parser.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.total = parse_size(args.total)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    stdout = sys.stdout
    figures: dict[str, Any] = {"benchmark": "bench_tiers", "sizes": args.sizes, "goal": {"ratio": 0.9}}
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-", dir=args.dir) as scratch:
        args.dir = Path(scratch)
        if args.json:
            sys.stdout = sys.stderr  # the tables; stdout keeps the JSON line
        try:
            for name in sections:
                figures[name] = SECTIONS[name](args)
        finally:
            sys.stdout = stdout
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
