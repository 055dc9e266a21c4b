"""Runs of consecutive rows in an index, and their copies as slices."""

from __future__ import annotations

from itertools import pairwise
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplug.builtins import index_runs as index_runs_module
from kvplug.builtins.index_runs import (
    MIN_MEAN_RUN_BYTES_WRITTEN,
    MIN_MEAN_RUN_ROWS,
    SpanRuns,
    gather_runs,
    index_runs,
    scatter_runs,
)


def test_runs_are_found_where_the_index_steps_by_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(index_runs_module, "MIN_MEAN_RUN_ROWS", 1)
    runs = index_runs(torch.tensor([4, 5, 6, 0, 9, 10, 3]))
    assert runs is not None
    assert runs.runs == ((0, 4, 3), (3, 0, 1), (4, 9, 2), (6, 3, 1))
    assert runs.numel == 7


def test_an_index_that_slices_cannot_follow_is_left_to_the_index_kernels() -> None:
    assert index_runs(torch.arange(-1, 63)) is None  # narrow() would wrap -1 to the last row
    assert index_runs(torch.arange(64).view(2, 32)) is None
    assert index_runs(torch.tensor([7])) is None  # one entry: nothing to gain
    assert index_runs(torch.tensor([7, 8])) is not None


def test_slicing_pays_only_for_long_runs() -> None:
    one_run = index_runs(torch.arange(256))  # a chunk of SGLang token slots handed out together
    scattered = index_runs(torch.randperm(256) * 2)
    short = index_runs((torch.arange(64) * 3).repeat_interleave(2) + torch.tensor([0, 1]).repeat(64))
    assert one_run is not None and scattered is not None and short is not None
    assert one_run.worth_slicing
    assert not scattered.worth_slicing
    assert len(short.runs) == 64 and not short.worth_slicing  # runs of two: vLLM blocks now and then adjacent
    assert MIN_MEAN_RUN_ROWS > 2


def test_writes_take_slices_from_runs_of_fewer_bytes_than_gathers() -> None:
    block = 32 * 1024  # a vLLM CPU block of the bench model (32 tokens)
    chunk = index_runs(torch.arange(40, 48))  # a chunk's eight blocks, allocated together
    pairs = index_runs(torch.tensor([3, 4, 9, 10, 20, 21, 30, 31]))
    apart = index_runs(torch.arange(8) * 2)
    assert chunk is not None and pairs is not None and apart is not None
    assert not chunk.worth_slicing  # index_select still wins for gathers
    assert chunk.worth_slicing_writes(block)
    assert not pairs.worth_slicing_writes(block) and pairs.worth_slicing_writes(2 * block)
    assert not apart.worth_slicing_writes(block)
    tokens = index_runs(torch.arange(256))  # token slots of 2 KiB
    assert tokens is not None and tokens.worth_slicing_writes(2048)
    assert 4 * block == MIN_MEAN_RUN_BYTES_WRITTEN


@mock.patch.object(index_runs_module, "MIN_MEAN_RUN_ROWS", 1)
@settings(max_examples=60, deadline=None)
@given(
    order=st.permutations(range(40)),
    count=st.integers(2, 40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
    dim=st.sampled_from([0, 1]),
)
def test_slices_copy_what_the_index_kernels_copy(order: list[int], count: int, cuts: list[int], dim: int) -> None:
    chosen = order[:count]
    bounds = [0, *sorted(c for c in cuts if c <= count), count]
    index = torch.tensor([v for a, b in pairwise(bounds) for v in sorted(chosen[a:b])])
    runs = index_runs(index)
    assert runs is not None
    rows = torch.randn(2, 40, 3) if dim == 1 else torch.randn(40, 3)

    out = torch.full((2, count, 3) if dim == 1 else (count, 3), float("nan"))
    gather_runs(rows, runs, out, dim)
    assert torch.equal(out, rows.index_select(dim, index))

    target, expected = torch.zeros_like(rows), torch.zeros_like(rows)
    scatter_runs(target, runs, out, dim)
    expected.index_copy_(dim, index, out)
    assert torch.equal(target, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (none on this machine)")
def test_a_device_index_is_not_read_back() -> None:
    assert index_runs(torch.arange(8, device="cuda")) is None


@settings(max_examples=100, deadline=None)
@given(
    index=st.lists(st.integers(-1, 12), max_size=40),
    spans=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=6),
)
def test_span_runs_are_the_runs_of_each_slice(index: list[int], spans: list[tuple[int, int]]) -> None:
    tensor = torch.tensor(index, dtype=torch.long)
    found = SpanRuns(tensor)
    negative = any(v < 0 for v in index)
    for a, b in spans:
        start, end = sorted((min(a, len(index)), min(b, len(index))))
        expected = None if negative else index_runs(tensor[start:end])
        assert found.of(start, end) == expected, (start, end)
