"""Runs of consecutive rows in a gather/scatter index, copied as slices.

Engines hand a new prompt consecutive slots or blocks whenever their free lists
allow (a fresh token pool, freed requests' slots handed out again, a request's
blocks allocated together). ``index_select``/``index_copy_`` move small rows
one by one well below ``copy_``'s speed once the cache is larger than the CPU caches:
a token-granular pool's 2 KiB rows went at about a third of ``copy_`` on a 2-core VM. A run of
rows copied as one slice is a plain ``copy_``. Each slice costs about 5 us of dispatch
here, so slices are used only when the runs are long: with runs of one or two 64 KiB
blocks of a block-paged cache, gathers as slices made stores two times slower.
``index_copy_`` is slower than ``index_select``, so writes take slices from shorter
runs (:data:`MIN_MEAN_RUN_ROWS` rows for gathers, :data:`MIN_MEAN_RUN_BYTES_WRITTEN`
bytes for writes).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplug.core.lazy_module import LazyModule

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Mean rows per run from which gathers as slices beat one ``index_select`` (benchmarks: runs
#: of hundreds of 2 KiB rows, store 24-26% -> 39-40% of ``copy_``, load 30-35% -> 45-55%).
MIN_MEAN_RUN_ROWS = 32

#: Mean bytes per run from which writes as slices beat one ``index_copy_``, whose CPU
#: kernel is the slower of the two (2-core VM, 96 MiB written in int64 words: runs of
#: four 32 KiB blocks 8.6 -> 6.1 ms, of eight 4.6 ms; two 64 KiB blocks 17.0 -> 13.0 ms;
#: 2 KiB rows tie at 32 per run and win from 64).
MIN_MEAN_RUN_BYTES_WRITTEN = 128 * 1024


@dataclass(frozen=True)
class IndexRuns:
    """An index as runs: ``index[at : at + length] == arange(first, first + length)``."""

    runs: tuple[tuple[int, int, int], ...]  # (at, first, length)
    numel: int

    @property
    def worth_slicing(self) -> bool:
        """Whether gathering each run as a slice beats one ``index_select`` (the runs are long)."""
        return bool(self.runs) and self.numel >= MIN_MEAN_RUN_ROWS * len(self.runs)

    def worth_slicing_writes(self, entry_bytes: int) -> bool:
        """Whether writing each run as a slice beats one ``index_copy_``; ``entry_bytes``: bytes per index entry."""
        return bool(self.runs) and self.numel * entry_bytes >= MIN_MEAN_RUN_BYTES_WRITTEN * len(self.runs)


def index_runs(index: torch.Tensor) -> IndexRuns | None:
    """The runs of consecutive values in a 1-D CPU index, or None where slices do not apply.

    A CUDA index is not inspected: reading it back would wait for the device. An
    index with negative entries is left to the index kernels, which reject it, and so
    is one of a single entry.
    """
    return SpanRuns(index).of(0, index.numel()) if index.dim() == 1 else None


class SpanRuns:
    """The runs of spans of one index, found in one pass over the whole index.

    An engine call covers many chunks, each a span of one slot tensor. Planning each
    chunk's slice alone took a dozen small torch ops per chunk, about 40 us: 1.2 ms
    for the 32 chunks of an 8192-token call, against 0.27 ms for the whole tensor at
    once (:meth:`kvplug.KVConnector.plan_many`). ``of(start, end)`` is what
    :func:`index_runs` returns for ``index[start:end]``, worked out in Python from
    the breaks found once. Where the index has a negative entry, every span is left
    to the index kernels.
    """

    def __init__(self, index: torch.Tensor) -> None:
        self._index: torch.Tensor | None = index  # scanned on the first call of of(): many plans need no runs
        self._values: list[int] = []
        self._breaks: list[int] = []  # positions i where index[i] != index[i - 1] + 1
        self._usable = index.dim() == 1 and index.device.type == "cpu" and index.numel() >= 2

    def _scan(self, index: torch.Tensor) -> None:
        self._index = None
        if not self._usable:
            return
        index = index.to(torch.long)
        if int(index.min()) < 0:  # narrow() would wrap a negative start; the index kernels reject it
            self._usable = False
            return
        self._breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
        self._values = index.tolist()

    def of(self, start: int, end: int) -> IndexRuns | None:
        """The runs of ``index[start:end]``, positions relative to ``start``; None where slices do not apply."""
        if self._index is not None:
            self._scan(self._index)
        if not self._usable or end - start < 2:
            return None
        inside = self._breaks[bisect.bisect_right(self._breaks, start) : bisect.bisect_left(self._breaks, end)]
        starts = [start, *inside]
        ends = [*inside, end]
        runs = tuple((at - start, self._values[at], stop - at) for at, stop in zip(starts, ends))
        return IndexRuns(runs, end - start)


def gather_runs(rows: torch.Tensor, runs: IndexRuns, out: torch.Tensor, dim: int) -> None:
    """``out[i] = rows[index[i]]`` along ``dim``, one ``copy_`` per run."""
    for at, first, length in runs.runs:
        out.narrow(dim, at, length).copy_(rows.narrow(dim, first, length))


def scatter_runs(rows: torch.Tensor, runs: IndexRuns, src: torch.Tensor, dim: int) -> None:
    """``rows[index[i]] = src[i]`` along ``dim``, one ``copy_`` per run (later runs win on overlap)."""
    for at, first, length in runs.runs:
        rows.narrow(dim, first, length).copy_(src.narrow(dim, at, length))
