"""Runs of consecutive rows in a gather/scatter index, copied as slices.

Engines hand a new prompt consecutive slots or blocks whenever their free lists
allow (a fresh token pool, freed requests' slots handed out again, a request's
blocks allocated together). ``index_select``/``index_copy_`` move small rows
one by one well below ``copy_``'s speed once the cache is larger than the CPU caches:
a token-granular pool's 2 KiB rows went at about a third of ``copy_`` on a 2-core VM. A run of
rows copied as one slice is a plain ``copy_``. Each slice costs about 5 us of dispatch
here, so slices are used only when the runs are long (:data:`MIN_MEAN_RUN_ROWS`):
with runs of one or two 64 KiB blocks of a block-paged cache, slices made stores two times slower.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Mean rows per run from which slices beat one indexed copy (benchmarks: runs of
#: hundreds of 2 KiB rows, store 24-26% -> 39-40% of ``copy_``, load 30-35% -> 45-55%).
MIN_MEAN_RUN_ROWS = 32


@dataclass(frozen=True)
class IndexRuns:
    """An index as runs: ``index[at : at + length] == arange(first, first + length)``."""

    runs: tuple[tuple[int, int, int], ...]  # (at, first, length)
    numel: int

    @property
    def worth_slicing(self) -> bool:
        """Whether copying each run as a slice beats one indexed copy (the runs are long)."""
        return bool(self.runs) and self.numel >= MIN_MEAN_RUN_ROWS * len(self.runs)


def index_runs(index: torch.Tensor) -> IndexRuns | None:
    """The runs of consecutive values in a 1-D CPU index, or None where slices do not apply.

    A CUDA index is not inspected: reading it back would wait for the device. An
    index with negative entries is left to the index kernels, which reject it, and so
    is one shorter than :data:`MIN_MEAN_RUN_ROWS` (a chunk of 16 blocks).
    """
    if index.dim() != 1 or index.device.type != "cpu" or index.numel() < MIN_MEAN_RUN_ROWS:
        return None  # too short to slice: skip the few tens of microseconds finding runs costs
    index = index.to(torch.long)
    if int(index.min()) < 0:  # narrow() would wrap a negative start; the index kernels reject it
        return None
    breaks = (torch.nonzero(index[1:] - index[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, index.numel()]
    firsts = index[starts].tolist()
    runs = tuple((at, first, end - at) for at, first, end in zip(starts, firsts, ends))
    return IndexRuns(runs, index.numel())


def gather_runs(rows: torch.Tensor, runs: IndexRuns, out: torch.Tensor, dim: int) -> None:
    """``out[i] = rows[index[i]]`` along ``dim``, one ``copy_`` per run."""
    for at, first, length in runs.runs:
        out.narrow(dim, at, length).copy_(rows.narrow(dim, first, length))


def scatter_runs(rows: torch.Tensor, runs: IndexRuns, src: torch.Tensor, dim: int) -> None:
    """``rows[index[i]] = src[i]`` along ``dim``, one ``copy_`` per run (later runs win on overlap)."""
    for at, first, length in runs.runs:
        rows.narrow(dim, first, length).copy_(src.narrow(dim, at, length))
