"""BackgroundWorker: every accepted item is handled, every other one is dropped and counted,
and queued chunk data is bounded in bytes as well as in items."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

from kvplug.core.background import BackgroundWorker


def test_submits_racing_close_are_each_handled_or_dropped_and_flush_never_hangs() -> None:
    """``submit`` and ``close`` decide under one lock, so an item submitted while close()
    runs is either handled or dropped, never both and never neither, and a flush()
    after close returns. Several submitters race one closer over a small queue, many
    times, so the interleavings vary."""
    for round_ in range(30):
        handled: list[int] = []
        dropped: list[int] = []
        worker: BackgroundWorker[int] = BackgroundWorker(
            f"race{round_}", handled.append, max_items=2, block_timeout_s=5, on_drop=dropped.append
        )
        go = threading.Barrier(5)

        def submit_many(first: int, worker: BackgroundWorker[int] = worker, go: threading.Barrier = go) -> None:
            go.wait(10)
            for item in range(first, first + 50):
                worker.submit(item)

        def close_soon(
            worker: BackgroundWorker[int] = worker, go: threading.Barrier = go, delay_s: float = 0.001 * (round_ % 5)
        ) -> None:
            go.wait(10)
            time.sleep(delay_s)
            worker.close()

        threads = [threading.Thread(target=submit_many, args=(k * 50,)) for k in range(4)]
        threads.append(threading.Thread(target=close_soon))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert not any(thread.is_alive() for thread in threads)
        flusher = threading.Thread(target=worker.flush, daemon=True)
        flusher.start()
        flusher.join(5)
        assert not flusher.is_alive(), "flush() hangs after close"
        assert not set(handled) & set(dropped)
        assert sorted(handled + dropped) == list(range(200))
        assert worker.submitted == len(handled) and worker.dropped == len(dropped)


def test_the_queue_is_bounded_in_bytes() -> None:
    release = threading.Event()
    sizes: list[int] = []

    def handle(item: bytes) -> None:
        release.wait(10)
        sizes.append(len(item))

    worker: BackgroundWorker[bytes] = BackgroundWorker(
        "bytes", handle, max_items=100, max_bytes=1000, size_of=len, on_full="drop"
    )
    try:
        assert worker.submit(b"x" * 600)  # taken by the thread, still held while it is handled
        assert not worker.submit(b"x" * 600)  # 1200 > 1000: dropped
        assert worker.submit(b"x" * 400)
        assert not worker.submit(b"x")
        assert worker.queued_bytes() == 1000 and worker.dropped == 2
        release.set()
        worker.flush()
        assert worker.queued_bytes() == 0 and sizes == [600, 400]
    finally:
        release.set()
        worker.close()


def test_one_item_over_the_byte_bound_passes_alone_instead_of_never() -> None:
    worker: BackgroundWorker[bytes] = BackgroundWorker(
        "big", lambda item: None, max_items=4, max_bytes=10, size_of=len, on_full="block", block_timeout_s=5
    )
    try:
        assert worker.submit(b"y" * 100)
        worker.flush()
    finally:
        worker.close()


def test_a_blocked_submit_waits_for_room_then_gives_up_at_its_timeout() -> None:
    release = threading.Event()
    worker: BackgroundWorker[bytes] = BackgroundWorker(
        "block", lambda item: release.wait(10), max_items=10, max_bytes=100, size_of=len, block_timeout_s=1.0
    )
    try:
        assert worker.submit(b"a" * 100)
        started = time.monotonic()
        assert not worker.submit(b"b" * 50)
        assert 0.95 <= time.monotonic() - started < 5
        waiter = threading.Thread(target=lambda: results.append(worker.submit(b"c" * 50)))
        results: list[bool] = []
        waiter.start()
        time.sleep(0.05)
        release.set()
        waiter.join(5)
        assert results == [True]
    finally:
        release.set()
        worker.close()


def test_a_submit_that_must_not_wait_drops_at_once_under_on_full_block() -> None:
    """``wait=False`` (a corrupt chunk's removal handed over by a load): a full queue drops
    the item at once, whatever ``on_full`` and ``block_timeout_s`` say."""
    release = threading.Event()
    dropped: list[str] = []
    worker: BackgroundWorker[str] = BackgroundWorker(
        "nowait", lambda item: release.wait(300), max_items=1, block_timeout_s=300, on_drop=dropped.append
    )
    try:
        assert worker.submit("being handled")
        assert worker.submit("queued")  # the queue is full now (the first is being handled)
        results: list[bool] = []
        submitter = threading.Thread(target=lambda: results.append(worker.submit("shed", wait=False)))
        submitter.start()
        submitter.join(30)
        assert results == [False] and dropped == ["shed"]
    finally:
        release.set()
        worker.close()


def test_close_without_drain_drops_what_is_queued_and_counts_it() -> None:
    started, release = threading.Event(), threading.Event()
    dropped: list[int] = []

    def handle(item: int) -> None:
        started.set()
        release.wait(10)

    def on_drop(item: int) -> None:
        dropped.append(item)
        release.set()  # the handled item may finish once the queue is discarded

    worker: BackgroundWorker[int] = BackgroundWorker("nodrain", handle, max_items=10, on_drop=on_drop)
    for i in range(4):
        worker.submit(i)
    assert started.wait(10)  # item 0 is being handled: 1, 2 and 3 are queued
    worker.close(drain=False)
    assert sorted(dropped) == [1, 2, 3] and worker.dropped == 3
    assert not worker.submit(9) and dropped[-1] == 9


def test_bad_bounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_items"):
        BackgroundWorker("bad", lambda item: None, max_items=0)
    with pytest.raises(ValueError, match="max_bytes"):
        BackgroundWorker("bad", lambda item: None, max_items=1, max_bytes=0, size_of=len)


def test_a_handled_item_is_not_kept_while_the_worker_waits_for_the_next() -> None:
    """A store batch holds frames of the engine's frame pool, which come back only when the
    last reference to them goes: an idle worker must not keep the last one it wrote."""

    class Batch:
        pass

    handled = threading.Event()
    worker: BackgroundWorker[Batch] = BackgroundWorker("test", lambda batch: handled.set(), max_items=4)
    batch = Batch()
    gone = weakref.ref(batch)
    assert worker.submit(batch)
    del batch
    assert handled.wait(30)
    worker.flush()
    gc.collect()
    assert gone() is None
    worker.close()


def test_discarding_during_a_draining_close_ends_it_after_the_item_in_hand() -> None:
    """A close that drains behind a handler that does not return (a hung tier) can be cut
    short: ``discard_queued`` drops what is still queued (counted), and the close ends when
    the item in hand is handled, not after every queued one."""
    gate, started = threading.Event(), threading.Event()
    handled: list[int] = []
    dropped: list[int] = []

    def handle(item: int) -> None:
        started.set()
        gate.wait(60)
        handled.append(item)

    worker: BackgroundWorker[int] = BackgroundWorker("cut", handle, max_items=8, on_drop=dropped.append)
    for item in range(4):
        assert worker.submit(item)
    assert started.wait(60)
    closing = threading.Thread(target=worker.close, daemon=True)
    closing.start()
    assert worker.discard_queued() == 3
    assert worker.pending() == 1 and dropped == [1, 2, 3]
    gate.set()
    closing.join(60)
    assert not closing.is_alive() and handled == [0] and worker.dropped == 3
