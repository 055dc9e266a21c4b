"""Storage tier throughput against the raw I/O underneath it, measured in the same run.

    python benchmarks/bench_tiers.py                       # every section, temp dir under /tmp
    python benchmarks/bench_tiers.py --dir /mnt/nvme/tmp --sizes 2MiB,8MiB,32MiB --total 512MiB
    python benchmarks/bench_tiers.py --sections disk       # one section

Sections (``SECTIONS``; each takes the parsed args and prints its own table):

- ``disk``: tier ``disk`` write and read GB/s next to raw ``write + fdatasync + rename``
  and raw ``open + read`` of the same values in the same folder; reads both hot (page
  cache) and cold (pages dropped with posix_fadvise DONTNEED, file by file, so no
  global cache drop is needed). Goal: tier >= 80% of raw.
- ``startup``: a disk tier's index rebuild over ``--index-files`` small records,
  next to a bare scandir + stat of the same tree (the least any rebuild must do).
- ``s3``: runs ``benchmarks/bench_s3_tier.py``'s ``run(args)`` when that file exists.
- ``valkey``: tier ``valkey`` put/get GB/s next to the raw valkey-py asyncio client (one
  pipeline per batch) on the same real valkey-server, standalone and 3-node cluster
  (``benchmarks/bench_valkey_tier.py``). Goal: tier >= 90% of raw.

Results are printed, never asserted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

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
            view = view[os.write(fd, view):]
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


def run_disk(args: argparse.Namespace) -> None:
    rows = [row for size in args.sizes for row in _measure_disk(args, size)]
    print_table(
        f"disk tier vs raw files in {args.dir} (best of {args.repeats}; write = write+fdatasync+rename; "
        f"tier batches {args.batch} values per put, background writer, flush included)",
        ["values", "op", "raw GB/s", "tier GB/s", "tier/raw"],
        rows,
    )


def _measure_disk(args: argparse.Namespace, size: int) -> list[tuple[object, ...]]:
    from kvplug_disk import DiskTier

    from kvplug.testing import key_for, tier_context

    count = max(4, args.total // size)
    distinct = [os.urandom(size) for _ in range(min(count, 4))]
    values = [distinct[i % len(distinct)] for i in range(count)]
    keys = [key_for(f"bench-{size}-{i}") for i in range(count)]
    gb = count * size / 1e9
    raw_dir = args.dir / f"raw-{size}"
    tier_dir = args.dir / f"tier-{size}"

    def tier_write() -> float:
        shutil.rmtree(tier_dir, ignore_errors=True)
        tier = DiskTier(DiskTier.Config(path=tier_dir, max_bytes=2 * count * size, on_queue_full="block"), tier_context())
        started = time.perf_counter()
        for at in range(0, count, args.batch):  # an engine stores a request's chunks as one batch
            tier.put(list(zip(keys[at : at + args.batch], values[at : at + args.batch])))
        tier.flush()
        elapsed = time.perf_counter() - started
        tier.close()
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
        (label, "write", gb / raw_w, gb / tier_w, f"{raw_w / tier_w:.0%}"),
        (label, "read (page cache)", gb / raw_hot, gb / tier_hot, f"{raw_hot / tier_hot:.0%}"),
        (label, "read (cold)", gb / raw_cold, gb / tier_cold, f"{raw_cold / tier_cold:.0%}"),
    ]


# --- startup -------------------------------------------------------------------------


def run_startup(args: argparse.Namespace) -> None:
    from kvplug_disk import DiskTier

    from kvplug.testing import key_for, tier_context

    folder = args.dir / "index"
    filler = DiskTier(DiskTier.Config(path=folder, writer="inline", fsync=False), tier_context())
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


# --- s3 ------------------------------------------------------------------------------


def run_s3(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    try:
        module = importlib.import_module("bench_s3_tier")
    except ModuleNotFoundError as exc:
        if exc.name != "bench_s3_tier":
            raise
        print("\ns3: benchmarks/bench_s3_tier.py is not there; skipped")
        return
    module.run(args)


def run_valkey(args: argparse.Namespace) -> None:
    """Tier ``valkey`` next to the raw valkey-py client, standalone and cluster (``bench_valkey_tier.py``)."""
    sys.path.insert(0, str(Path(__file__).parent))
    importlib.import_module("bench_valkey_tier").run(args)


SECTIONS: dict[str, Callable[[argparse.Namespace], None]] = {
    "disk": run_disk,
    "startup": run_startup,
    "s3": run_s3,
    "valkey": run_valkey,
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
    args = parser.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.total = parse_size(args.total)
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-", dir=args.dir) as scratch:
        args.dir = Path(scratch)
        for name in sections:
            SECTIONS[name](args)


if __name__ == "__main__":
    main()
