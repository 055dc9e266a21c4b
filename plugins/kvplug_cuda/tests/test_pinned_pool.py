"""The staging pool: bounded, reused, and a deadline instead of an unbounded wait."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvplug.errors import PinnedPoolExhaustedError
from kvplug_cuda import PinnedPool

KIB = 1024


def make_pool(capacity: int = 256 * KIB, timeout_s: float = 0.05, reclaim=None) -> PinnedPool:
    return PinnedPool(capacity, pin=False, timeout_s=timeout_s, reclaim=reclaim)


def test_buffers_are_reused_not_reallocated() -> None:
    pool = make_pool()
    first = pool.acquire(100 * KIB)
    address = first.tensor.data_ptr()
    pool.release(first)
    for _ in range(5):
        buffer = pool.acquire(90 * KIB)  # same 128 KiB size class
        assert buffer.tensor.data_ptr() == address
        pool.release(buffer)
    stats = pool.stats()
    assert (stats.allocations, stats.reuses, stats.acquires) == (1, 5, 6)
    assert stats.in_use_bytes == 0 and stats.allocated_bytes == 128 * KIB


def test_the_pool_never_holds_more_than_its_capacity() -> None:
    pool = make_pool(capacity=256 * KIB)
    held = [pool.acquire(64 * KIB) for _ in range(4)]
    assert pool.stats().allocated_bytes == 256 * KIB
    for buffer in held:
        pool.release(buffer)
    # idle 64 KiB buffers are dropped to make room for a bigger size class
    big = pool.acquire(200 * KIB)
    stats = pool.stats()
    assert big.size == 256 * KIB and stats.allocated_bytes == 256 * KIB <= stats.capacity_bytes
    pool.release(big)


def test_an_exhausted_pool_raises_after_its_deadline_and_counts_a_miss() -> None:
    pool = make_pool(capacity=128 * KIB, timeout_s=0.05)
    held = pool.acquire(128 * KIB)
    started = time.monotonic()
    with pytest.raises(PinnedPoolExhaustedError, match="came free within 0.05s"):
        pool.acquire(64 * KIB)
    assert 0.04 <= time.monotonic() - started < 5
    assert pool.stats().misses == 1
    pool.release(held)
    pool.release(pool.acquire(64 * KIB))  # usable again once released


def test_a_request_larger_than_the_pool_fails_at_once() -> None:
    pool = make_pool(capacity=128 * KIB, timeout_s=30)
    with pytest.raises(PinnedPoolExhaustedError, match="exceeds the pinned pool's capacity"):
        pool.acquire(200 * KIB)
    assert pool.stats().misses == 1


def test_a_release_from_another_thread_wakes_a_waiter() -> None:
    waiting = threading.Event()

    def nothing_to_reclaim(deadline: float) -> bool:
        waiting.set()  # the acquire below found the pool full and is about to wait
        return False

    pool = make_pool(capacity=64 * KIB, timeout_s=10, reclaim=nothing_to_reclaim)
    held = pool.acquire(64 * KIB)
    releaser = threading.Thread(target=lambda: waiting.wait(10) and pool.release(held))
    releaser.start()
    buffer = pool.acquire(64 * KIB)
    releaser.join()
    assert buffer.tensor.data_ptr() == held.tensor.data_ptr()
    assert pool.stats().waits == 1


def test_reclaim_is_asked_before_waiting() -> None:
    pool = make_pool(capacity=64 * KIB, timeout_s=10)
    in_flight = [pool.acquire(64 * KIB)]

    def reclaim(deadline: float) -> bool:
        if not in_flight:
            return False
        pool.release(in_flight.pop())
        return True

    pool.reclaim = reclaim
    buffer = pool.acquire(1)
    assert not in_flight and buffer.nbytes == 1


def test_views_cover_only_the_requested_bytes() -> None:
    pool = make_pool()
    buffer = pool.acquire(6 * 4)
    view = buffer.view(torch.float32, (2, 3))
    assert view.shape == (2, 3) and view.data_ptr() == buffer.tensor.data_ptr()


def test_close_drops_free_buffers_and_refuses_new_ones() -> None:
    pool = make_pool()
    out = pool.acquire(64 * KIB)
    pool.release(pool.acquire(128 * KIB))
    pool.close()
    pool.release(out)
    assert pool.stats().allocated_bytes == 0
    with pytest.raises(PinnedPoolExhaustedError, match="closed"):
        pool.acquire(1)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="at least"):
        PinnedPool(1000, pin=False, timeout_s=1)
    with pytest.raises(ValueError, match="non-negative"):
        make_pool().acquire(-1)
