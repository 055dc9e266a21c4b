"""The connector's parts that need no running engine: registration, settings,
stats, the lookup socket and request keys (with vLLM's own classes where they exist)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvplug
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
from kvplug.errors import ConfigError, LayoutError
from kvplug_vllm.layout import VLLM_CPU, VLLM_CPU_MLA, VLLM_MLA, detect_layout
from kvplug_vllm.lookup import DirectLookup, LookupChannelError, SocketLookup, socket_path
from kvplug_vllm.registration import CONNECTOR_NAME, register
from kvplug_vllm.request_state import request_info
from kvplug_vllm.settings import request_overrides, split_extra_config


def test_vllm_entry_point_registers_the_connector_once() -> None:
    (entry,) = [e for e in entry_points(group="vllm.general_plugins") if e.value.startswith("kvplug_vllm")]
    assert entry.load() is register
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    register()
    register()  # vLLM calls general plugins once per process, more than once in tests
    config = SimpleNamespace(kv_connector=CONNECTOR_NAME, kv_connector_module_path=None)
    from kvplug_vllm.connector import KVPlugConnector

    assert KVConnectorFactory.get_connector_class(config) is KVPlugConnector


def test_kvplug_lists_the_vllm_engine_adapter() -> None:
    adapters = kvplug.get_registry().engine_adapters()
    assert adapters["vllm"].engine_version() == "0.32.0"


def test_the_lookup_folder_variable_is_not_an_unknown_setting() -> None:
    # vLLM's engine processes inherit KVPLUG_LOOKUP_DIR from the adapter; the adapter
    # declares it, so the config loader does not take it for a misspelled setting.
    load_config(env={"KVPLUG_LOOKUP_DIR": "/run/user/0/kvplug"})
    with pytest.raises(ConfigError, match="KVPLUG_LOOKUP_DIRS"):
        load_config(env={"KVPLUG_LOOKUP_DIRS": "/run/user/0/kvplug"})


def test_extra_config_split_between_connector_and_core() -> None:
    settings, rest = split_extra_config(
        {
            "kvplug.layerwise": True,
            "kvplug.chunk_size": 128,
            "kvplug": {"skip_last_n_tokens": 3, "hash": "xxh3_128"},
            "kvplug.config": "kvplug.yaml",
            "other": 1,
        }
    )
    assert settings.layerwise and settings.skip_last_n_tokens == 3
    assert rest == {
        "kvplug.chunk_size": 128,
        "kvplug": {"hash": "xxh3_128"},
        "kvplug.config": "kvplug.yaml",
        "other": 1,
    }
    rest.pop("kvplug.config")
    config = load_config(engine_extra=rest, env={}).config
    assert (config.chunk_size, config.hash) == (128, "xxh3_128")


def test_bad_connector_setting_names_the_key() -> None:
    with pytest.raises(ConfigError, match="kvplug.skip_last_n_tokens"):
        split_extra_config({"kvplug.skip_last_n_tokens": -1})


@pytest.mark.parametrize(
    ("extra", "path", "meant"),
    [
        ({"kvplug.layerwse": True}, "kvplug.layerwse", "layerwise"),
        ({"kvplug": {"lookup_timout_s": 2.0}}, "kvplug.lookup_timout_s", "lookup_timeout_s"),
        ({"kvplug.chunk_sise": 128}, "kvplug.chunk_sise", "chunk_size"),
        ({"kvplug.stroe.queue.mode": "sync"}, "kvplug.stroe.queue.mode", "store"),
    ],
)
def test_a_misspelled_setting_is_named_with_the_connector_and_core_names(
    extra: dict[str, object], path: str, meant: str
) -> None:
    """The core's own error listed only its fields, so a misspelled connector setting got a
    list without the setting meant."""
    with pytest.raises(ConfigError) as info:
        split_extra_config(extra)
    [problem] = info.value.problems
    assert problem.path == path and f"did you mean {meant!r}?" in problem.message, str(info.value)
    assert "layerwise" in problem.message and "chunk_size" in problem.message


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("kvplug.lookup_timeout_s", float("inf"), "less than or equal to 3600"),
        ("kvplug.lookup_timeout_s", float("nan"), "less than or equal to 3600"),
        ("kvplug.load_timeout_s", 1e12, "less than or equal to 3600"),
    ],
)
def test_connector_timeouts_are_finite_and_bounded(key: str, value: float, bound: str) -> None:
    """``lookup_timeout_s: .inf`` was accepted (a lookup that never gives up)."""
    with pytest.raises(ConfigError) as info:
        split_extra_config({key: value})
    [problem] = info.value.problems
    assert problem.path == key and bound in problem.message, str(info.value)


@pytest.mark.parametrize(
    ("old", "value", "new"),
    [
        ("lookup", "direct", "kvplug.lookup_channel"),
        ("lookups", "blocking", "kvplug.background_lookups"),
        ("load_timeout_ms", 500, "kvplug.load_timeout_s"),
    ],
)
def test_a_renamed_connector_setting_names_its_new_name(old: str, value: Any, new: str) -> None:
    for extra in ({f"kvplug.{old}": value}, {"kvplug": {old: value}}):
        with pytest.raises(ConfigError) as info:
            split_extra_config(extra)
        [problem] = info.value.problems
        assert problem.path == f"kvplug.{old}" and problem.message.startswith(f"renamed to {new!r}"), str(info.value)


def test_timeouts_are_seconds() -> None:
    settings, _ = split_extra_config({"kvplug.load_timeout_s": 0.5, "kvplug.lookup_timeout_s": 2})
    assert (settings.load_timeout_s, settings.lookup_timeout_s) == (0.5, 2.0)
    assert load_config(engine_extra={"kvplug.lookup_budget_s": 0.05}, env={}).config.lookup_budget_s == 0.05


def test_per_request_settings_are_checked() -> None:
    config = load_config(env={}).config
    assert request_overrides({"kvplug.skip_save": True, "kvplug.report": True, "other": 1}, config) == {
        "skip_save": True
    }
    with pytest.raises(ConfigError, match="chunk_size: cannot be set per request"):
        request_overrides({"kvplug.chunk_size": 8}, config)


def test_connector_stats_aggregate_and_rebuild() -> None:
    from kvplug_vllm.connector import KVPlugConnector
    from kvplug_vllm.stats import KVPlugConnectorStats

    worker = KVPlugConnectorStats()
    worker.add(loaded_tokens=64, load_error_blocks=2)
    scheduler = KVPlugConnectorStats()
    scheduler.add(lookups=2, lookup_tokens=400, hit_tokens=100)
    assert KVPlugConnectorStats().is_empty() and not worker.is_empty()
    rebuilt = KVPlugConnector.build_kv_connector_stats(worker.aggregate(scheduler).to_dict())
    reduced = rebuilt.reduce()
    assert (reduced["loaded_tokens"], reduced["lookups"], reduced["load_error_blocks"]) == (64, 2, 2)
    assert reduced["hit_rate"] == 0.25
    rebuilt.reset()
    assert rebuilt.is_empty()


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


# --- KV cache groups kvplug refuses at start-up ------------------------------------------


def kv_cache_config(*specs: object) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)]
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)


def test_kv_cache_groups_kvplug_cannot_key_are_refused_naming_the_model() -> None:
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from kvplug_vllm.kv_groups import check_kv_cache_groups

    model = SimpleNamespace(model_config=SimpleNamespace(model="org/hybrid-ssm"))
    full = FullAttentionSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16)
    window = SlidingWindowSpec(block_size=32, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, sliding_window=16)
    mamba = MambaSpec(block_size=32, shapes=((4, 8),), dtypes=(torch.float32,))
    check_kv_cache_groups(model, kv_cache_config(full))  # one group of attention KV: served
    check_kv_cache_groups(model, kv_cache_config(window))  # every layer sliding: served (test_hybrid.py)
    served = check_kv_cache_groups(model, kv_cache_config(window, full))  # vLLM's hybrid allocator: served
    assert [g.describe(2) for g in served] == ["kv_group=0/2:sliding16", "kv_group=1/2:full"]
    refused = r"'org/hybrid-ssm': KV cache group 1 of 2 \(FullAttentionSpec, MambaSpec\) is a MambaSpec group: it holds"
    with pytest.raises(kvplug.errors.UnsupportedModelError, match=refused):
        check_kv_cache_groups(model, kv_cache_config(full, mamba))
    with pytest.raises(kvplug.errors.UnsupportedModelError, match=r"'org/hybrid-ssm'.*MambaSpec group: it holds"):
        check_kv_cache_groups(model, kv_cache_config(mamba))


# --- MLA on vLLM's CPU backend ------------------------------------------------------------


def mla_config(use_mla: bool) -> SimpleNamespace:
    """The parts of a VllmConfig ``detect_layout`` reads, for a DeepSeek-V2 style model."""
    model = SimpleNamespace(use_mla=use_mla, get_num_kv_heads=lambda _: 1, get_head_size=lambda: 576)
    return SimpleNamespace(model_config=model, parallel_config=SimpleNamespace())


def test_vllm_cpu_mla_cache_is_detected_only_for_an_mla_model() -> None:
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(8, 1, 16, 576, dtype=torch.bfloat16) for i in range(2)}
    layout = detect_layout(caches, mla_config(True))
    assert layout.format == VLLM_CPU_MLA and layout.num_kv == 1
    assert (layout.block_size, layout.num_kv_heads, layout.head_dim) == (16, 1, 576)
    with pytest.raises(LayoutError, match=r"\(8, 1, 16, 576\).*MLA model: False"):
        detect_layout(caches, mla_config(False))
    # another format's chunks of the same sizes are keyed apart: a miss, never misread
    texts = {KVLayout(f, 2, 16, 1, 576, torch.bfloat16).describe() for f in (VLLM_CPU_MLA, VLLM_MLA)}
    texts.add(KVLayout(VLLM_CPU, 2, 16, 1, 288, torch.bfloat16).describe())
    assert len(texts) == 3


@pytest.mark.parametrize("connector", ["torch", "native"])
def test_vllm_cpu_mla_latent_rows_round_trip_bit_exactly(connector: str) -> None:
    layout = KVLayout(VLLM_CPU_MLA, num_layers=2, block_size=16, num_kv_heads=1, head_dim=576, dtype=torch.bfloat16)
    extra = {"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync", "kvplug.connector": {"type": connector}}
    config = load_config(engine_extra=extra, env={}).config
    generator = torch.Generator().manual_seed(3)
    # random bytes (NaN patterns too) in vLLM's shape; the target starts as zeros
    source = [torch.randint(0, 2**16, (12, 1, 16, 576), generator=generator, dtype=torch.int32)
              .to(torch.int16).view(torch.bfloat16) for _ in range(2)]  # fmt: skip
    target = [torch.zeros_like(t) for t in source]
    tokens = list(range(100, 196))  # 96 tokens: one whole chunk and a half
    src_slots = slots_from_block_ids([5, 2, 9, 0, 7, 11], 16, 96)
    dst_slots = slots_from_block_ids([1, 10, 3, 8, 4, 6], 16, 96)
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="unit")) as cache_engine:
        assert type(cache_engine.connector).__name__.lower().startswith(connector)
        assert cache_engine.store(tokens, source, src_slots) == 64
        assert cache_engine.retrieve(tokens[:64], target, dst_slots[:64]).all()
    for src, dst in zip(source, target):
        # vLLM's CPU MLA backends address a token's latent row as cache.view(-1, 576)[slot]
        src_rows, dst_rows = src.view(-1, 576).view(torch.int16), dst.view(-1, 576).view(torch.int16)
        assert torch.equal(dst_rows[dst_slots[:64]], src_rows[src_slots[:64]])
        untouched = torch.ones(dst_rows.shape[0], dtype=torch.bool)
        untouched[dst_slots[:64]] = False
        assert not dst_rows[untouched].any(), "a row outside the loaded slots was written"


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
