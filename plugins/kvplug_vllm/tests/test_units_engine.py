"""The connector's parts that need a CacheEngine but no running vLLM engine: the lookup
socket, the keys of a request and the worker's stats (with vLLM's own classes where they exist)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvplug import (
    CacheEngine,
    ChunkLocation,
    ControlIdentity,
    ControlServer,
    Fingerprint,
    KVLayout,
    RequestInfo,
    load_config,
    slots_from_block_ids,
)
from kvplug.core.control.client import ask
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.lookup import DirectLookup, LookupChannelError, SocketLookup, socket_path
from kvplug_vllm.request_state import request_info

# --- the lookup channel ------------------------------------------------------------------

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.fixture
def engine():
    layout = LAYOUT
    config = load_config(engine_extra={"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}, env={}).config
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="unit")) as cache_engine:
        yield cache_engine


def store(engine: CacheEngine, tokens: list[int], request: RequestInfo | None = None) -> None:
    caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
    engine.store(tokens, caches, slots_from_block_ids(list(range(1, 16)), 32, len(tokens)), request=request)


def serve(engine: CacheEngine, path: Path, on_reset: Callable[[], int] | None = None) -> ControlServer:
    """The control server a vLLM worker runs (its scheduler's lookups and resets go to it)."""
    return ControlServer(engine, ControlIdentity(path.stem, "unit", "vllm"), path, on_reset=on_reset)


def test_socket_lookup_answers_like_the_engine(engine: CacheEngine) -> None:
    prompt = list(range(3, 203))
    store(engine, prompt, RequestInfo(cache_salt="a"))
    store(engine, prompt, RequestInfo(lora_id="sql-adapter"))  # the scheduler sends LoRA names
    path = socket_path(f"unit-{id(engine):x}", 0, 0)
    server = serve(engine, path)
    client = SocketLookup([path], timeout_s=5)
    try:
        for info in (
            RequestInfo(cache_salt="a"),
            RequestInfo(cache_salt="b"),
            RequestInfo(),
            RequestInfo(lora_id="sql-adapter"),
            RequestInfo(lora_id="other-adapter"),
        ):
            assert client.locate(prompt, info) == DirectLookup([engine], []).locate(prompt, info)
        assert client.lookup(prompt, RequestInfo(lora_id="sql-adapter")) == 192
        assert client.lookup(prompt, RequestInfo(cache_salt="a")) == 192
        assert client.lookup(prompt[:100] + [5] * 100, RequestInfo(cache_salt="a")) == 64
    finally:
        server.close()
    assert not path.exists()
    assert not [t for t in threading.enumerate() if t.name == "kvplug-control-server"]
    with pytest.raises(LookupChannelError):  # the scheduler turns this into a miss
        client.lookup(prompt, RequestInfo(cache_salt="a"))
    client.close()


def test_one_socket_answers_the_schedulers_lookups_and_resets_and_kvplug_ctl(engine: CacheEngine) -> None:
    prompt = list(range(3, 203))
    store(engine, prompt)
    resets: list[int] = []
    path = socket_path(f"unit-one-{id(engine):x}", 0, 0)
    server = serve(engine, path, on_reset=lambda: resets.append(1) or 7)
    client = SocketLookup([path], timeout_s=5)
    try:
        assert client.locate(prompt, RequestInfo()) == [ChunkLocation("memory", "cpu", 64)] * 3
        assert client.reset() == 7 and resets == [1]
        assert ask(path, "info")["engine_id"] == path.stem  # kvplug ctl, on the same socket
        assert path.name.startswith("ctl-")
    finally:
        client.close()
        server.close()


def test_stale_socket_of_a_killed_worker_is_removed(engine: CacheEngine) -> None:
    import socket

    stale = socket_path(f"unit-stale-{id(engine):x}", 0, 0)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(stale))
    listener.close()  # what a SIGKILLed worker leaves: the file, nobody listening
    os.utime(stale, (time.time() - 120, time.time() - 120))  # and it is not brand new
    path = socket_path(f"unit-live-{id(engine):x}", 0, 0)
    server = serve(engine, path)
    try:
        assert not stale.exists() and path.exists()
    finally:
        server.close()


def test_lookup_server_survives_a_bad_request(engine: CacheEngine) -> None:
    import socket
    import struct

    path = socket_path(f"unit-bad-{id(engine):x}", 0, 0)
    server = serve(engine, path)
    try:
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(str(path))
            garbage = struct.pack("<I", 3) + b"{}x"  # header length longer than the body
            raw.sendall(struct.pack("<I", len(garbage)) + garbage)
            assert raw.recv(4) == b""  # a malformed request: its connection is closed
        assert SocketLookup([path], timeout_s=5).lookup([1, 2, 3], RequestInfo()) == 0
    finally:
        server.close()


# --- keys of a request ---------------------------------------------------------------------


def mm_request(image_hash: str) -> SimpleNamespace:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    feature = MultiModalFeatureSpec(
        data=None,
        modality="image",
        identifier=f"lora-x:{image_hash}",
        mm_position=PlaceholderRange(offset=70, length=40),
        mm_hash=image_hash,
    )
    return SimpleNamespace(
        mm_features=[feature], cache_salt="t1", lora_request=None, kv_transfer_params={"kvplug.skip_save": True}
    )


def test_multimodal_hashes_key_the_chunks_they_cover(engine: CacheEngine) -> None:
    config = load_config(env={}).config
    info = request_info(mm_request("img-1"), config)
    assert info.cache_salt == "t1" and info.overrides == {"skip_save": True}
    assert [(k.start, k.end) for k in info.extra_keys] == [(70, 110)]
    prompt = list(range(3, 203))
    store(engine, prompt, RequestInfo(cache_salt="t1", extra_keys=info.extra_keys))
    other = request_info(mm_request("img-2"), config)
    assert engine.lookup(prompt, request=RequestInfo(cache_salt="t1", extra_keys=info.extra_keys)) == 192
    # another image at the same placeholder: the chunks up to the image still hit
    assert engine.lookup(prompt, request=RequestInfo(cache_salt="t1", extra_keys=other.extra_keys)) == 64


# --- a worker's stats -----------------------------------------------------------------------


def test_worker_stats_pass_engine_metrics_on_by_name_and_label(engine: CacheEngine) -> None:
    from kvplug_vllm.stats import KVPlugConnectorStats
    from kvplug_vllm.worker import WorkerSide

    worker = SimpleNamespace(
        engine=engine, _stats=KVPlugConnectorStats(), _metric_marks={}, _worked=False, _busy_s=0.0, _first_rank=True
    )
    store(engine, list(range(3, 203)))  # 3 whole chunks of 64
    engine.metrics.load_errors.labels("CorruptChunkError").inc(2)
    engine.metrics.store_dropped.labels("engine").inc()
    engine.metrics.remote_breaker_state.labels("1:s3,{x=y}").set(2)  # label text is data, never parsed
    engine.metrics.tier_errors.labels("0:cpu", "get").inc()  # not passed on
    stats = WorkerSide.get_kv_connector_stats(worker)  # type: ignore[arg-type]
    assert stats is not None
    data = {k: v for k, v in stats.data.items() if v}
    # the cpu tier's bytes of unsalted requests: 3 chunks and their fingerprint manifest
    assert data.pop("gauge.tenant_bytes.0:cpu|(unsalted)") >= engine.metrics.value("kvplug_stored_bytes_total")
    assert data == {
        "stored_tokens": 192,
        "stored_bytes": engine.metrics.value("kvplug_stored_bytes_total"),
        "load_errors.CorruptChunkError": 2,
        "store_dropped.engine": 1,
        "gauge.breaker_state.1:s3,{x=y}": 2.0,
    }
    engine.metrics.load_errors.labels("CorruptChunkError").inc()
    again = WorkerSide.get_kv_connector_stats(worker)  # type: ignore[arg-type]
    assert again is None or {k: v for k, v in again.data.items() if v} == {"load_errors.CorruptChunkError": 1}


def test_a_worker_of_another_rank_passes_bytes_but_not_the_engines_tokens(engine: CacheEngine) -> None:
    """Every tensor-parallel rank stores (and loads) its heads of the same tokens: vLLM sums the
    workers' stats, so only the first rank counts tokens; each rank's bytes are its own."""
    from kvplug_vllm.stats import KVPlugConnectorStats
    from kvplug_vllm.worker import WorkerSide

    worker = SimpleNamespace(
        engine=engine, _stats=KVPlugConnectorStats(), _metric_marks={}, _worked=False, _busy_s=0.0, _first_rank=False
    )
    store(engine, list(range(3, 203)))
    stats = WorkerSide.get_kv_connector_stats(worker)  # type: ignore[arg-type]
    assert stats is not None
    assert (stats.data["stored_tokens"], stats.data["stored_bytes"]) == (
        0,
        engine.metrics.value("kvplug_stored_bytes_total"),
    )
