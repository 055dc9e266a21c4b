"""A tier whose writes hang (a stuck remote or mount) never holds SGLang's scheduler: the
radix-cache backend's steps, stores and exit, and the HiCache backend's close; a tier whose
reads hang never holds SGLang's HiCache prefetch threads."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from sglang_flow import build_stack, published_server_args, serve_request
from test_sglang_hicache import PAGE, make_backend, make_host, page_keys, random_pages

import kvplug
from kvplug.core.records.manifest import KeyScheme
from kvplug_cpu import CPUTier
from kvplug_sglang import at_exit

pytestmark = pytest.mark.usefixtures("registered")


_GATE = threading.Event()


class _GatedTier(CPUTier):
    """A cpu tier whose writes wait until the test opens the gate (a remote that does not answer)."""

    name = "gated_cpu"

    def put(self, items: Any) -> None:
        _GATE.wait(timeout=300)
        super().put(items)


_READ_GATE = threading.Event()


class _ReadGatedTier(CPUTier):
    """A cpu tier whose reads wait while the test holds the gate shut (a hung mount)."""

    name = "read_gated_cpu"

    def contains(self, keys: Any) -> list[bool]:
        _READ_GATE.wait(timeout=300)
        return super().contains(keys)

    def get(self, keys: Any) -> Any:
        _READ_GATE.wait(timeout=300)
        return super().get(keys)


class _GatedPlugin:
    @staticmethod
    @kvplug.hookimpl
    def kvplug_storage_tiers() -> list[type]:
        return [_GatedTier, _ReadGatedTier]


def test_the_scheduler_step_never_waits_for_the_tiers(
    model_config, kvplug_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SGLang calls flush_pending_backups after every batch ("submit queued host backups"):
    kvplug's store worker writes in the background, so it must not wait for a tier whose
    write does not finish (a slow or unreachable remote)."""
    registry = kvplug.get_registry()
    if not registry.pm.has_plugin("gated-cpu-test"):
        registry.register(_GatedPlugin, "gated-cpu-test")
    _GATE.clear()
    monkeypatch.setenv("KVPLUG_STORE__QUEUE__MODE", "async")
    monkeypatch.setenv("KVPLUG_TIERS", json.dumps([{"type": "gated_cpu", "queue": {"mode": "async"}}]))
    try:
        with published_server_args(radix_cache_backend="kvplug") as args:
            stack = build_stack(args, model_config)
            serve_request(stack, "a", list(range(800, 849)), seed=1)  # its store waits at the gate
            step = threading.Thread(target=stack.tree.flush_pending_backups, daemon=True)
            step.start()
            step.join(timeout=60)
            blocked = step.is_alive()
            _GATE.set()
            assert not blocked, "the scheduler step waited for a tier write"
            stack.tree.shutdown()  # an exit still writes what is queued
    finally:
        _GATE.set()


@contextlib.contextmanager
def _gated_stack(model_config: Any, monkeypatch: pytest.MonkeyPatch, **queue: Any) -> Iterator[Any]:
    """A radix cache over one sync tier whose writes wait at the (closed) gate until the
    test opens it; ``queue``: the store queue's settings."""
    registry = kvplug.get_registry()
    if not registry.pm.has_plugin("gated-cpu-test"):
        registry.register(_GatedPlugin, "gated-cpu-test")
    _GATE.clear()
    for name, value in {"mode": "async", **queue}.items():
        monkeypatch.setenv(f"KVPLUG_STORE__QUEUE__{name.upper()}", str(value))
    monkeypatch.setenv("KVPLUG_TIERS", json.dumps([{"type": "gated_cpu", "queue": {"mode": "sync"}}]))
    try:
        with published_server_args(radix_cache_backend="kvplug") as args:
            yield build_stack(args, model_config)
    finally:
        _GATE.set()


def _returns_while_gated(call: Any) -> bool:
    """Whether ``call()`` returns (within a generous minute) while the gate stays closed."""
    step = threading.Thread(target=call, daemon=True)
    step.start()
    step.join(timeout=60)
    return not step.is_alive()


def test_a_first_store_never_writes_a_tier_on_the_scheduler_thread(
    model_config, kvplug_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first store of a fingerprint also writes its manifest (for kvplug explain): into
    every tier, a sync (queue-less) shared one too. A tier whose writes hang (a stuck remote
    or filesystem) must hold kvplug's store worker only, never SGLang's scheduler."""
    with _gated_stack(model_config, monkeypatch) as stack:
        served = _returns_while_gated(lambda: serve_request(stack, "a", list(range(700, 749)), seed=1))
        _GATE.set()
        assert served, "the scheduler's store waited for a tier write"
        engine = stack.tree.engine
        engine.flush()  # the manifest still goes to the tier, from the store worker
        (fingerprint,) = engine.records.fingerprints
        assert engine.chain.contains_any([KeyScheme.of(fingerprint, 16, "sha256").manifest_key()]) == [True]
        stack.tree.shutdown()


def test_a_full_store_queue_sheds_stores_instead_of_holding_the_scheduler(
    model_config, kvplug_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``store.queue.on_full: block`` would hold SGLang's scheduler (every batch) for up to
    block_timeout_s while the tiers are stuck: under SGLang a store the full queue cannot take
    at once is shed and counted, and serving goes on."""
    with _gated_stack(model_config, monkeypatch, max_items=1, on_full="block", block_timeout_s=600) as stack:
        # The first store holds the worker at the gate, the second fills the queue, the rest are shed.
        prompts = [list(range(1000 + 100 * i, 1049 + 100 * i)) for i in range(4)]
        served = _returns_while_gated(lambda: [serve_request(stack, f"r{i}", p, seed=i) for i, p in enumerate(prompts)])
        _GATE.set()
        assert served, "a store waited for room in the store queue"
        assert stack.tree.engine.metrics.value("kvplug_store_dropped_total", queue="engine") >= 1
        stack.tree.shutdown()


def test_an_exit_waits_a_bounded_time_for_a_tier_whose_writes_hang(
    model_config, kvplug_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At a normal exit kvplug drains its queued stores into the tiers; a tier whose write
    never finishes (a hung mount) must not hold the scheduler process forever."""
    monkeypatch.setattr(at_exit, "EXIT_WAIT_S", 1.0, raising=False)
    with _gated_stack(model_config, monkeypatch) as stack:
        serve_request(stack, "a", list(range(1700, 1749)), seed=1)  # its store waits at the gate
        exited = _returns_while_gated(at_exit._close_all)
        _GATE.set()
        assert exited, "the exit hook waited for a tier write that does not finish"
        stack.tree.shutdown()


def _gate_hicache_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``gated_cpu`` tier registered, its writes held at the gate, and a close of the
    HiCache backend waiting 1 s for them."""
    from kvplug import get_registry
    from kvplug_sglang import at_exit

    registry = get_registry()
    if not registry.pm.has_plugin("gated-cpu-test"):
        registry.register(_GatedPlugin, "gated-cpu-test")
    monkeypatch.setattr(at_exit, "EXIT_WAIT_S", 1.0, raising=False)
    _GATE.clear()


def test_closing_the_backend_waits_a_bounded_time_for_a_tier_whose_writes_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SGLang closes its storage backend on the scheduler thread (a storage detach, its exit
    hook): kvplug's close drains the tiers' queued writes, and a tier whose write never
    finishes (a hung mount) must not hold the scheduler forever."""
    _gate_hicache_closes(monkeypatch)
    try:
        host = make_host("layer_first")
        backend = make_backend(host, {"tiers": [{"type": "gated_cpu", "queue": {"mode": "async"}}]})
        indices = random_pages(host, 2, seed=3)
        assert backend.batch_set_v1(page_keys(list(range(8))), indices) == [True, True]  # queued at the gate
        closing = threading.Thread(target=backend.close, daemon=True)
        closing.start()
        closing.join(timeout=60)
        closed = not closing.is_alive()
        _GATE.set()
        assert closed, "close waited for a tier write that does not finish"
    finally:
        _GATE.set()


def test_a_close_that_timed_out_drops_the_queued_writes_and_ends_with_the_write_in_hand(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a close (a storage detach) gave up waiting on a tier whose write does not
    finish, the closing thread, which nothing can stop inside the tier's call, must not go
    on to write every batch still queued (each could hang as long): those are dropped,
    counted, and the thread ends when the write in hand returns."""
    _gate_hicache_closes(monkeypatch)
    try:
        host = make_host("layer_first")
        backend = make_backend(host, {"tiers": [{"type": "gated_cpu", "queue": {"mode": "async"}}]})
        for batch in range(4):  # the first is held at the gate, three wait behind it
            indices = random_pages(host, 1, seed=batch)
            assert backend.batch_set_v1(page_keys(list(range(100 * batch, 100 * batch + PAGE))), indices) == [True]
        store = backend.store
        assert store is not None
        backend.close()  # gives up after EXIT_WAIT_S, the gate still closed
        dropped = store.metrics.value("kvplug_store_dropped_total", queue="0:gated_cpu")
        closer = [t for t in threading.enumerate() if t.name == "kvplug-close"]
        _GATE.set()
        for thread in closer:
            thread.join(timeout=60)
        assert dropped == 3, f"{dropped} queued batches dropped when the close gave up"
        assert not any(t.is_alive() for t in closer), "the closing thread went on after the write in hand"
    finally:
        _GATE.set()


def test_a_closed_backend_reports_writes_failed_and_reads_missed() -> None:
    """After a close (a storage detach) a backup that SGLang still sends is written nowhere:
    it is reported failed, not stored, so SGLang does not count those pages as backed up;
    reads are misses."""
    host = make_host("layer_first")
    backend = make_backend(host, {"tiers": [{"type": "cpu"}]})
    indices = random_pages(host, 2, seed=5)
    keys = page_keys(list(range(500, 500 + 2 * PAGE)))
    assert backend.batch_set_v1(keys, indices) == [True, True]
    backend.close()
    assert backend.batch_set_v1(keys, indices) == [False, False]
    assert backend.batch_get_v1(keys, indices) == [False, False]
    assert backend.batch_exists(keys) == 0


def test_lookups_and_loads_from_a_tier_whose_reads_hang_are_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's prefetch threads wait on batch_exists and batch_get_v1 (a prefetch's host memory
    is released, and the next one starts, when they return): with a tier stuck in its reads
    they return misses, and the late read never writes the host pages SGLang may have reused.
    Once the tier answers again, pages load."""
    _gate_hicache_closes(monkeypatch)
    _READ_GATE.set()
    host = make_host("layer_first")
    backend = make_backend(host, {"tiers": [{"type": "read_gated_cpu"}]}, extra={"read_timeout_s": 0.5})
    keys = page_keys(list(range(700, 700 + 2 * PAGE)))
    src = random_pages(host, 2, seed=12)
    assert backend.batch_set_v1(keys, src) == [True, True]
    dst = host.alloc(2 * PAGE)
    before = [host.get_data_page(int(dst[i])).clone() for i in (0, PAGE)]
    answers: dict[str, Any] = {}
    _READ_GATE.clear()
    try:
        reading = threading.Thread(
            target=lambda: answers.update(get=backend.batch_get_v1(keys, dst), exists=backend.batch_exists(keys)),
            daemon=True,
        )
        reading.start()
        reading.join(timeout=60)
        returned = not reading.is_alive()
    finally:
        _READ_GATE.set()
    late = [t for t in threading.enumerate() if t.name == "kvplug-hicache-read"]
    for thread in late:  # the reads given up end once the tier answers
        thread.join(timeout=60)
    try:
        assert returned, "a HiCache read waited for a tier that does not answer"
        assert answers == {"get": [False, False], "exists": 0}
        assert all(torch.equal(a, host.get_data_page(int(dst[i]))) for a, i in zip(before, (0, PAGE))), (
            "a late read wrote the host pages"
        )
        assert backend.batch_exists(keys) == 2 and backend.batch_get_v1(keys, dst) == [True, True]
        assert backend.store is not None
        assert backend.store.metrics.value("kvplug_load_errors_total", reason="deadline") == 2  # the pages given up
    finally:
        backend.close()


def test_a_read_that_gets_no_thread_is_a_miss_and_frees_its_room(monkeypatch: pytest.MonkeyPatch) -> None:
    """A read runs on a thread of its own; where none can be started (a container's pids limit
    reached: a fault a test cannot cause for real without starving itself, so Thread.start is
    made to fail) the read is a miss, and its room is free again: once threads can be had,
    pages load (not every read a miss, as if earlier reads were stuck in a tier)."""
    from kvplug_sglang import bounded_reads

    starts_failing = [bounded_reads.MAX_READS_IN_FLIGHT]

    class _NoThread(threading.Thread):
        def start(self) -> None:
            if self.name == "kvplug-hicache-read" and starts_failing[0] > 0:
                starts_failing[0] -= 1
                raise RuntimeError("can't start new thread")
            super().start()

    host = make_host("layer_first")
    backend = make_backend(host, {"tiers": [{"type": "cpu"}]})
    keys = page_keys(list(range(900, 900 + 2 * PAGE)))
    assert backend.batch_set_v1(keys, random_pages(host, 2, seed=14)) == [True, True]
    monkeypatch.setattr(bounded_reads.threading, "Thread", _NoThread)
    try:
        assert [backend.batch_exists(keys) for _ in range(bounded_reads.MAX_READS_IN_FLIGHT)] == [0, 0, 0, 0]
        assert backend.batch_exists(keys) == 2, "reads that got no thread kept their room"
        assert backend.batch_get_v1(keys, host.alloc(2 * PAGE)) == [True, True]
    finally:
        backend.close()
