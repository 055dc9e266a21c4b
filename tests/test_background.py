"""BackgroundWorker: every accepted item is handled, every other one is dropped and counted,
and queued chunk data is bounded in bytes as well as in items."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from kvplug.core.background import BackgroundWorker


def test_a_submit_racing_close_is_handled_or_dropped_and_flush_never_hangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A submit that saw the worker open while close() ran must not land behind the stop
    marker: there it was never handled, and a later flush() waited forever.

    The submit is held between its check and its enqueue (where a thread switch can put
    it) by delaying ``queue.Queue.put`` for that one item; a worker that does not enqueue
    through ``queue.Queue`` is not slowed at all."""
    in_put, go = threading.Event(), threading.Event()
    real_put = queue.Queue.put

    def preempted_put(self: queue.Queue[object], item: object, *args: object, **kwargs: object) -> None:
        if item == "c":
            in_put.set()
            go.wait(10)
        real_put(self, item, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(queue.Queue, "put", preempted_put)
    release = threading.Event()
    handled: list[str] = []

    def handle(item: str) -> None:
        release.wait(10)
        handled.append(item)

    worker: BackgroundWorker[str] = BackgroundWorker("race", handle, max_items=1, block_timeout_s=10)
    try:
        assert worker.submit("a")  # taken by the thread, which blocks on it
        deadline = time.monotonic() + 5
        while not (worker.pending() == 1 and worker.submit("b")):  # b fills the queue
            assert time.monotonic() < deadline
            time.sleep(0.001)
        late: list[bool] = []
        submitter = threading.Thread(target=lambda: late.append(worker.submit("c")))
        submitter.start()
        in_put.wait(0.5)
        closer = threading.Thread(target=worker.close)
        closer.start()
        time.sleep(0.05)  # close is waiting for room for its stop marker
        go.set()
        time.sleep(0.05)
        release.set()
        submitter.join(10)
        closer.join(10)
        assert not closer.is_alive() and not submitter.is_alive()
        flusher = threading.Thread(target=worker.flush, daemon=True)
        flusher.start()
        flusher.join(5)
        assert not flusher.is_alive(), "flush() hangs on an item queued after close"
        assert handled == ["a", "b", "c"][: 2 + late[0]]
        assert worker.submitted == len(handled) and worker.submitted + worker.dropped == 3
    finally:
        go.set()
        release.set()


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
        "block", lambda item: release.wait(10), max_items=10, max_bytes=100, size_of=len, block_timeout_s=0.3
    )
    try:
        assert worker.submit(b"a" * 100)
        started = time.monotonic()
        assert not worker.submit(b"b" * 50)
        assert 0.25 <= time.monotonic() - started < 3
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


def test_close_without_drain_drops_what_is_queued_and_counts_it() -> None:
    release = threading.Event()
    dropped: list[int] = []
    worker: BackgroundWorker[int] = BackgroundWorker(
        "nodrain", lambda item: release.wait(10), max_items=10, on_drop=dropped.append
    )
    for i in range(4):
        worker.submit(i)
    time.sleep(0.05)
    closer = threading.Thread(target=worker.close, kwargs={"drain": False})
    closer.start()
    time.sleep(0.05)
    release.set()
    closer.join(5)
    assert sorted(dropped) == [1, 2, 3] and worker.dropped == 3
    assert not worker.submit(9) and dropped[-1] == 9


def test_bad_bounds_are_rejected() -> None:
    with pytest.raises(ValueError, match="max_items"):
        BackgroundWorker("bad", lambda item: None, max_items=0)
    with pytest.raises(ValueError, match="max_bytes"):
        BackgroundWorker("bad", lambda item: None, max_items=1, max_bytes=0, size_of=len)
