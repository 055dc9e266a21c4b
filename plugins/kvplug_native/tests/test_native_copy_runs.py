"""The C extension ``kvplug_native._copy`` on hand-built run tables, its build flags, and the run tables themselves."""

from __future__ import annotations

import platform
import subprocess
import sys
import threading
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from native_helpers import FLASH, HND, PACKED, PACKED_KV, UNWRITTEN, make_caches

from kvplug import KVLayout
from kvplug_native import _copy
from kvplug_native.runs import DST, NBYTES, SRC, find_runs, split_table

LENGTHS = [0, 1, 15, 16, 17, 63, 64, 65, 127, 128, 131, 4096 + 7, 65536 + 13]


def _buffers(size: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    source = torch.randint(0, UNWRITTEN, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return source, torch.full((size,), UNWRITTEN, dtype=torch.uint8)


def _copy_table(
    rows: list[tuple[int, int, int]], source: torch.Tensor, destination: torch.Tensor, streaming: bool, threads: int
) -> torch.Tensor:
    """Copy ``rows`` (destination offset, source offset, bytes) with copy_runs; return what plain slicing expects."""
    expected = destination.clone()
    for dst, src, nbytes in rows:
        expected[dst : dst + nbytes] = source[src : src + nbytes]
    table = torch.tensor(
        [[destination.data_ptr() + dst, source.data_ptr() + src, nbytes] for dst, src, nbytes in rows],
        dtype=torch.int64,
    ).reshape(-1, 3)
    _copy.copy_runs(table.data_ptr(), table.shape[0], streaming, threads)
    return expected


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_copies_runs_of_every_length_at_unaligned_addresses(streaming: bool, threads: int) -> None:
    size = 2 * sum(LENGTHS) + 64 * len(LENGTHS) * 2
    source, destination = _buffers(size)
    rows, dst, src = [], 0, 5
    for index, nbytes in enumerate(LENGTHS):
        dst += index % 16 + 1  # destinations 1..16 bytes past the last run: every alignment
        src += 7
        rows.append((dst, src, nbytes))
        dst += nbytes
        src += nbytes
    # Sources read backwards (not continuing each other): the prefetched path.
    rows.reverse()
    expected = _copy_table(rows, source, destination, streaming, threads)
    assert torch.equal(destination, expected)
    assert int((destination != UNWRITTEN).sum()) == sum(LENGTHS)  # the gaps between runs stay unwritten


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("threads", [1, 2, 4])
def test_many_small_scattered_runs(streaming: bool, threads: int) -> None:
    """Thousands of 2..256-byte runs from shuffled sources into shuffled places: a gather out of a paged cache."""
    generator = torch.Generator().manual_seed(threads)
    count, unit = 4000, 272
    source, destination = _buffers(count * unit, seed=1)
    places = torch.randperm(count, generator=generator).tolist()
    origins = torch.randperm(count, generator=generator).tolist()
    lengths = torch.randint(2, 257, (count,), generator=generator).tolist()
    shifts = torch.randint(0, 16, (count,), generator=generator).tolist()
    rows = [(p * unit + s, o * unit + s, n) for p, o, n, s in zip(places, origins, lengths, shifts)]
    expected = _copy_table(rows, source, destination, streaming, threads)
    assert torch.equal(destination, expected)


@settings(max_examples=40, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 31), st.integers(0, 31)), min_size=1, max_size=12),
    streaming=st.booleans(),
    threads=st.integers(1, 4),
)
def test_any_runs_copy_exactly(runs: list[tuple[int, int, int]], streaming: bool, threads: int) -> None:
    """Runs of any length at any offsets (destination runs disjoint, sources anywhere)."""
    rows, dst, src = [], 0, 0
    for nbytes, dst_gap, src_gap in runs:
        dst += dst_gap
        src += src_gap
        rows.append((dst, src, nbytes))
        dst += nbytes
        src += nbytes // 2  # sources may overlap each other
    source, destination = _buffers(max(dst, src + 5000) + 64, seed=len(runs))
    expected = _copy_table(rows, source, destination, streaming, threads)
    assert torch.equal(destination, expected)


def test_a_large_streamed_copy_on_several_threads() -> None:
    """A few megabytes in runs of uneven sizes, streamed on 4 threads (the guided schedule shares them out)."""
    source, destination = _buffers(6 * 2**20 + 4096, seed=3)
    sizes = [2**20 + 3, 5, 2**19 - 1, 2**20 + 17, 64, 3 * 2**19 + 9, 2**18]
    rows, offset = [], 0
    for size in sizes:
        rows.append((offset + 1, offset + 2, size))
        offset += size + 48
    expected = _copy_table(rows, source, destination, True, 4)
    assert torch.equal(destination, expected)


def test_an_empty_table_copies_nothing() -> None:
    _copy.copy_runs(0, 0, True, 1)  # no table at all: nothing to read
    source, destination = _buffers(64)
    expected = _copy_table([(3, 0, 0), (10, 5, 0)], source, destination, True, 2)  # runs of no bytes
    assert torch.equal(destination, expected) and bool((destination == UNWRITTEN).all())


@pytest.mark.parametrize(
    "count, threads, match",
    [
        (-1, 1, "count must not be negative"),
        (1, 0, "threads must be at least 1"),
        (2, -2, "threads must be at least 1"),
    ],
)
def test_bad_counts_and_threads_are_value_errors(count: int, threads: int, match: str) -> None:
    """Checked before anything is copied (the table here is valid: a missing check would copy, not crash)."""
    source, destination = _buffers(64)
    table = torch.tensor([[destination.data_ptr(), source.data_ptr(), 32]] * 2, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        _copy.copy_runs(table.data_ptr(), count, True, threads)
    assert bool((destination == UNWRITTEN).all())


@pytest.mark.parametrize("count, threads", [(1, 1), (3, 4)])
def test_a_table_at_address_zero_is_a_value_error(count: int, threads: int) -> None:
    with pytest.raises(ValueError, match="table address is 0"):
        _copy.copy_runs(0, count, False, threads)


def test_copy_runs_releases_the_gil() -> None:
    """While one thread copies, Python code runs on another: its longest pause is far below one copy's time."""
    size = 64 * 2**20
    source, destination = torch.full((size,), 7, dtype=torch.uint8), torch.zeros(size, dtype=torch.uint8)
    # The same 64 MiB four times over: one call long enough to see (tens of milliseconds) in little memory.
    table = torch.tensor([[destination.data_ptr(), source.data_ptr(), size]] * 4, dtype=torch.int64)

    def copy() -> float:
        started = time.perf_counter()
        _copy.copy_runs(table.data_ptr(), 4, False, 1)
        return time.perf_counter() - started

    copy()  # fault the pages in
    alone = min(copy() for _ in range(3))
    done = threading.Event()

    def copies() -> None:
        for _ in range(3):
            copy()
        done.set()

    thread = threading.Thread(target=copies)
    last, longest = time.perf_counter(), 0.0
    thread.start()
    while not done.is_set():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    thread.join()
    assert torch.equal(destination, source)
    # Holding the GIL, a copy would stall the main thread for all of it (at least `alone`); the
    # margin leaves room for a busy machine's scheduling.
    assert longest < alone * 0.8, f"the main thread stalled {longest * 1e3:.1f} ms; one copy takes {alone * 1e3:.1f} ms"


# --- build flags ---------------------------------------------------------------------------


def test_streaming_stores_on_x86_64() -> None:
    expected = 1 if platform.machine() in ("x86_64", "AMD64") else 0
    assert expected == _copy.STREAMING_STORES


def test_built_with_openmp_on_linux() -> None:
    assert _copy.OPENMP in (0, 1)
    if sys.platform.startswith("linux"):
        assert _copy.OPENMP == 1


_MAPPED_GOMP = """
import torch
import kvplug_native._copy as copy
torch.ones(1000).sum()  # torch's OpenMP runtime in use
with open("/proc/self/maps") as maps:
    paths = {line.split()[-1] for line in maps if "gomp" in line.rsplit("/", 1)[-1]}
print(copy.OPENMP, len(paths), *sorted(paths))
"""


def test_the_extension_shares_torchs_openmp_runtime() -> None:
    """One OpenMP runtime in the process: the extension links libgomp.so.1, the one torch loaded."""
    # In a fresh process, so that nothing else this session imported could have loaded a runtime.
    out = subprocess.run([sys.executable, "-c", _MAPPED_GOMP], capture_output=True, text=True, check=True).stdout
    openmp, count, *paths = out.split()
    assert openmp == "1"
    assert count == "1", paths
    assert "libgomp" in paths[0]
    # And in this process, after everything the suite imported.
    with open("/proc/self/maps") as maps:
        mapped = {line.split()[-1] for line in maps if "gomp" in line.rsplit("/", 1)[-1]}
    assert len(mapped) == 1, mapped


# --- run tables ----------------------------------------------------------------------------


def _blocks(blocks: list[int], size: int) -> torch.Tensor:
    return (torch.tensor(blocks)[:, None] * size + torch.arange(size)).flatten()


def test_runs_merge_consecutive_blocks_of_a_chunk_but_never_across_chunks() -> None:
    layout = KVLayout(FLASH, num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    (cache,) = make_caches(layout, 8, torch.Generator().manual_seed(0)).layers
    row = 2 * 8 * 2  # bytes of one token's heads
    slots = _blocks([2, 3, 4, 7, 0, 1], 4)

    runs = find_runs(layout, [cache], slots, [(0, 24)], [])
    assert [run.kv_index for run in runs] == [0, 1]
    for run in runs:  # blocks 2-4, 7, 0-1
        assert run.nbytes.tolist() == [12 * row, 4 * row, 8 * row]
        assert run.target.tolist() == [0, 12 * row, 16 * row]
        assert run.source.tolist() == [
            (run.kv_index * 32 + 8) * row,
            (run.kv_index * 32 + 28) * row,
            run.kv_index * 32 * row,
        ]
        assert run.chunk.tolist() == [0, 0, 0]

    split = find_runs(layout, [cache], slots, [(0, 8), (8, 24)], [])[0]  # blocks 2-3 | 4, 7, 0-1
    assert split.chunk.tolist() == [0, 1, 1, 1]
    assert split.nbytes.tolist() == [8 * row, 4 * row, 4 * row, 8 * row]
    assert split.target.tolist() == [0, 0, 4 * row, 8 * row]  # relative to each chunk

    mid = find_runs(layout, [cache], slots, [(2, 10)], [])[0]  # from mid-block 2 into block 4
    assert mid.nbytes.tolist() == [8 * row] and mid.source.tolist() == [10 * row]


def test_runs_of_a_cache_without_dense_token_rows_are_per_head() -> None:
    layout = KVLayout(HND, num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    (cache,) = make_caches(layout, 4, torch.Generator().manual_seed(0)).layers
    slots = torch.tensor([5, 6, 7, 12])
    run = find_runs(layout, [cache], slots, [(0, 4)], [])[1]
    assert run.nbytes.tolist() == [16] * 8  # a head's row per token and head
    block, token = torch.tensor([1, 1, 1, 3]), torch.tensor([1, 2, 3, 0])
    source = (1 * 4 * 2 * 4 * 8 + block[:, None] * 2 * 4 * 8 + torch.arange(2) * 4 * 8 + token[:, None] * 8) * 2
    assert run.source.tolist() == source.flatten().tolist()
    assert run.target.tolist() == [i * 16 for i in range(8)]

    # Block 1's last row (head 1, token 3) is followed in memory by block 2's first (head 0, token 0): one run.
    follows = find_runs(layout, [cache], torch.tensor([7, 8]), [(0, 2)], [])[0]
    assert follows.nbytes.tolist() == [16, 32, 16]

    one_head = KVLayout(HND, num_layers=1, block_size=4, num_kv_heads=1, head_dim=8, dtype=torch.float16)
    (cache,) = make_caches(one_head, 4, torch.Generator().manual_seed(0)).layers
    merged = find_runs(one_head, [cache], slots, [(0, 4)], [])[0]
    assert merged.nbytes.tolist() == [48, 16]  # tokens 5-7 of block 1 are one run; then block 3's first


def test_runs_of_a_cache_whose_head_dim_is_strided_are_none() -> None:
    layout = KVLayout(FLASH, num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float16)
    cache = torch.zeros(2, 4, 4, 8, 2, dtype=torch.float16).transpose(3, 4)
    assert find_runs(layout, [cache], torch.arange(8), [(0, 8)], []) is None


def test_packed_runs_merge_consecutive_whole_blocks() -> None:
    layout = KVLayout(PACKED_KV, num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    (pair,) = make_caches(layout, 8, torch.Generator().manual_seed(0)).layers
    block = 2 * 4 * 8 * 2
    blocks = [torch.tensor([3, 4, 5, 1])]
    runs = find_runs(layout, list(pair), _blocks([3, 4, 5, 1], 4), [(0, 16)], blocks)
    assert [(run.kv_index, run.tensor) for run in runs] == [(0, 0), (1, 1)]
    for run in runs:
        assert run.nbytes.tolist() == [3 * block, block]
        assert run.source.tolist() == [3 * block, block]
        assert run.target.tolist() == [0, 3 * block]

    packed = KVLayout(PACKED, num_layers=1, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    (cache,) = make_caches(packed, 8, torch.Generator().manual_seed(0)).layers
    runs = find_runs(packed, [cache], _blocks([3, 4], 4), [(0, 8)], [torch.tensor([3, 4])])
    inner = 4 * 8 * 2  # a head's K (or V) half of a block
    for run in runs:  # K and V halves interleave by head: nothing merges
        assert run.nbytes.tolist() == [inner] * 4
        assert run.source.tolist() == [(b * 4 + h * 2 + run.kv_index) * inner for b in (3, 4) for h in (0, 1)]
        assert run.target.tolist() == [i * inner for i in range(4)]


@pytest.mark.parametrize(
    "nbytes", [[100, 1, 1, 1, 100, 50, 50, 7, 0, 90], [1, 1, 1, 1, 1, 1, 1, 1000, 1000, 1000], [5] * 7]
)
def test_split_table_shares_rows_in_order_by_bytes(nbytes: list[int]) -> None:
    """The copy threads' shares without OpenMP: consecutive whole rows, each within one row of its fair bytes."""
    table = torch.tensor([[i, 1000 + i, n] for i, n in enumerate(nbytes)], dtype=torch.int64)
    for parts in (2, 3, 4, 20):
        shares = split_table(table, parts)
        assert 1 <= len(shares) <= parts
        assert all(share.shape[0] > 0 for share in shares)
        assert torch.equal(torch.cat(shares), table)  # consecutive, whole rows, nothing lost or repeated
        fair = sum(nbytes) / parts + max(nbytes)
        assert all(int(share[:, NBYTES].sum()) <= fair for share in shares)
    if len(set(nbytes)) == 1:  # rows of equal bytes: a row per share when there are as many parts
        assert [share.shape[0] for share in split_table(table, len(nbytes))] == [1] * len(nbytes)
    assert len(split_table(table, 1)) == 1 and split_table(table, 1)[0] is table
    assert split_table(table[:0], 4) == []
    assert (DST, SRC, NBYTES) == (0, 1, 2)
