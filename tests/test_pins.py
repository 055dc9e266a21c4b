"""CacheEngine.pin / unpin, the config's pin: prefixes, and per-tenant quotas through an engine."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import CacheEngine, ExtraKey, Fingerprint, PinReport, RequestInfo, load_config
from kvplug.core.plugins import PluginRegistry

LAYOUT = LAYOUTS["vllm_flash"]
SYSTEM = list(range(5000, 5032))  # 4 chunks of 8 tokens


def one_off(i: int) -> list[int]:
    return [100_000 + 1000 * i + t for t in range(32)]


def make(registry: PluginRegistry, **extra: object) -> CacheEngine:
    settings = {
        "kvplug.store.queue.mode": "sync",
        "kvplug.chunk_size": 8,
        **{f"kvplug.{k}": v for k, v in extra.items()},
    }
    config = load_config(engine_extra=settings, env={}, registry=registry).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="pins"), registry=registry)


def test_pin_before_and_after_the_store_and_unpin(registry: PluginRegistry) -> None:
    with make(registry, tiers=[{"type": "cpu", "max_bytes": "64KiB", "pin_max_bytes": "50%"}]) as engine:
        salted = RequestInfo(cache_salt="tenant-a")
        assert engine.pin(SYSTEM[:16], request=salted) == PinReport(chunks=0, bytes=0, refused=0, missing=2)
        caches = random_caches(LAYOUT, 16)
        engine.store(SYSTEM, caches, torch.arange(32), request=salted)
        # The first two chunks were pinned as they were stored; pinning the prompt pins the other two.
        pinned = engine.pin(SYSTEM, request=salted)
        size = pinned.bytes // 4  # one chunk's frame
        assert pinned == PinReport(chunks=4, bytes=4 * size, refused=0, missing=0, tokens=32)
        assert engine.chain.tiers[0].stats().extra["pinned_bytes"] == 4 * size
        for i in range(64 * 1024 // (4 * size) * 3):  # a scan that fills the tier three times over
            engine.store(one_off(i), caches, torch.arange(32))
        assert engine.lookup(SYSTEM, request=salted) == 32
        assert engine.lookup(one_off(0)) == 0
        assert engine.unpin(SYSTEM, request=salted) == PinReport(
            chunks=4, bytes=4 * size, refused=0, missing=0, tokens=32
        )
        for i in range(64 * 1024 // (4 * size) * 3):
            engine.store(one_off(1000 + i), caches, torch.arange(32))
        assert engine.lookup(SYSTEM, request=salted) == 0


ADAPTER = RequestInfo(cache_salt="tenant-a", lora_id="sql", extra_keys=(ExtraKey.adapter_source("/lora/sql-v2"),))


@pytest.mark.parametrize(
    ("pin", "salted"),
    [
        ("{salt: tenant-a, prefix_file: prompts/system.json}", RequestInfo(cache_salt="tenant-a")),
        ("{salt: tenant-a, lora_id: sql, lora_path: /lora/sql-v2, prefix_file: prompts/system.json}", ADAPTER),
    ],
    ids=["salt", "salt-and-lora"],
)
def test_configured_pins_read_their_prefix_file_beside_the_config(
    registry: PluginRegistry, tmp_path: Path, pin: str, salted: RequestInfo
) -> None:
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "system.json").write_text(json.dumps(SYSTEM))
    (tmp_path / "kvplug.yaml").write_text(
        "chunk_size: 8\nstore: {queue: {mode: sync}}\n"
        "tiers: [{type: cpu, max_bytes: 64KiB, pin_max_bytes: 50%, eviction: s3fifo}]\n"
        f"pin: [{pin}]\n"
    )
    config = load_config(config_file=tmp_path / "kvplug.yaml", env={}, registry=registry).config
    assert config.pin[0].prefix_file == tmp_path / "prompts" / "system.json"
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="pins"), registry=registry) as engine:
        caches = random_caches(LAYOUT, 16)
        engine.store(SYSTEM, caches, torch.arange(32), request=salted)
        for i in range(200):
            engine.store(one_off(i), caches, torch.arange(32))
        assert engine.lookup(SYSTEM, request=salted) == 32
        assert engine.lookup(SYSTEM) == 0  # unsalted: other keys, never pinned


def test_a_prefix_file_past_any_prompt_is_refused_at_its_bound(
    registry: PluginRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A configured pin's file is read only up to ``TOKEN_FILE_MAX_BYTES`` (``/dev/zero`` or a
    wrong file named as the prefix would fill memory): the pin is skipped, the engine serves."""
    from kvplug.core.tenancy import TOKEN_FILE_MAX_BYTES

    huge = tmp_path / "huge.txt"
    huge.write_bytes(b" " * (TOKEN_FILE_MAX_BYTES + 1))  # blank: read whole, it was an empty prefix
    (tmp_path / "kvplug.yaml").write_text(
        f"chunk_size: 8\ntiers: [{{type: cpu, max_bytes: 64KiB, pin_max_bytes: 50%}}]\npin: [{{prefix_file: {huge}}}]\n"
    )
    config = load_config(config_file=tmp_path / "kvplug.yaml", env={}, registry=registry).config
    with caplog.at_level("ERROR", logger="kvplug"):
        engine = CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="pins"), registry=registry)
    with engine:
        assert f"over {TOKEN_FILE_MAX_BYTES} bytes" in caplog.text
        assert "that pin is not applied" in caplog.text


@pytest.mark.parametrize("ids", ["1 2 99999999999999999999", "[5, -1, 7]"], ids=["past-int64", "negative"])
def test_a_prefix_file_of_token_ids_out_of_range_is_skipped_and_the_engine_serves(
    registry: PluginRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture, ids: str
) -> None:
    """Chunk keys hash token ids as int64: a configured pin's file with an id past it raised
    OverflowError out of CacheEngine() (the engine did not start). It is skipped, naming the id."""
    (tmp_path / "ids.txt").write_text(ids)
    (tmp_path / "kvplug.yaml").write_text(
        "chunk_size: 8\nstore: {queue: {mode: sync}}\n"
        "tiers: [{type: cpu, max_bytes: 64KiB, pin_max_bytes: 50%}]\npin: [{prefix_file: ids.txt}]\n"
    )
    config = load_config(config_file=tmp_path / "kvplug.yaml", env={}, registry=registry).config
    with caplog.at_level("ERROR", logger="kvplug"):
        engine = CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="pins"), registry=registry)
    with engine:
        assert "is not between 0 and 2**63 - 1" in caplog.text and "that pin is not applied" in caplog.text
        engine.store(SYSTEM, random_caches(LAYOUT, 16), torch.arange(32))
        assert engine.lookup(SYSTEM) == 32  # it serves


def test_a_prefix_file_that_is_a_fifo_is_refused_without_waiting_for_a_writer(
    registry: PluginRegistry, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A configured pin's ``prefix_file`` that is a FIFO was opened for reading, which waits for
    a writer: CacheEngine() never returned (the engine did not start). It is refused at once."""
    fifo = tmp_path / "prefix.fifo"
    os.mkfifo(fifo)
    (tmp_path / "kvplug.yaml").write_text(
        "chunk_size: 8\ntiers: [{type: cpu, max_bytes: 64KiB, pin_max_bytes: 50%}]\npin: [{prefix_file: prefix.fifo}]\n"
    )
    config = load_config(config_file=tmp_path / "kvplug.yaml", env={}, registry=registry).config
    made: list[CacheEngine] = []

    def start() -> None:
        made.append(CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="pins"), registry=registry))

    with caplog.at_level("ERROR", logger="kvplug"):
        starting = threading.Thread(target=start, daemon=True)
        starting.start()
        starting.join(60)  # a hang guard, not a speed bound: it returns at once or never
        if starting.is_alive():  # a writer lets the blocked open return (it reads an empty prefix)
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            starting.join(60)
    for engine in made:
        engine.close()
    assert made and "not a regular file" in caplog.text, "CacheEngine() waited for a writer on the FIFO"


def test_a_tenant_over_its_quota_evicts_its_own_chunks_through_the_engine(registry: PluginRegistry) -> None:
    tiers = [{"type": "cpu", "max_bytes": "256KiB", "quotas": {"tenant-a": "10%", "default": "20%"}}]
    with make(registry, tiers=tiers, tenancy={"tenants": {"tenant-a": "a-secret"}}) as engine:
        caches = random_caches(LAYOUT, 16)
        b = RequestInfo(cache_salt="b-secret")
        engine.store(SYSTEM, caches, torch.arange(32), request=b)
        a = RequestInfo(cache_salt="a-secret")
        for i in range(40):  # tenant-a alone would fill the tier more than twice
            engine.store(one_off(i), caches, torch.arange(32), request=a)
        assert engine.lookup(SYSTEM, request=b) == 32
        assert engine.lookup(one_off(0), request=a) == 0
        assert engine.lookup(one_off(39), request=a) == 32
        held = engine.metrics.value("kvplug_tenant_bytes", tier="0:cpu", tenant="tenant-a")
        assert 0 < held <= 256 * 1024 // 10
        assert engine.metrics.value("kvplug_tenant_bytes", tier="0:cpu", tenant="(other)") > 0  # tenant-b
        assert engine.metrics.value("kvplug_quota_evictions_total", tier="0:cpu") > 0


@pytest.mark.parametrize("request_flag", [True, False])
def test_the_per_request_pin_setting(registry: PluginRegistry, request_flag: bool) -> None:
    tiers = [{"type": "cpu", "max_bytes": "64KiB", "pin_max_bytes": "50%", "request_pin_max_bytes": "50%"}]
    with make(registry, tiers=tiers, tenancy={"request_pins": True}) as engine:
        caches = random_caches(LAYOUT, 16)
        info = RequestInfo(overrides={"pin_request": True} if request_flag else {})
        engine.store(SYSTEM, caches, torch.arange(32), request=info)
        for i in range(200):
            engine.store(one_off(i), caches, torch.arange(32))
        assert engine.lookup(SYSTEM) == (32 if request_flag else 0)


@pytest.mark.parametrize("when", ["after_store", "before_store", "request"])
def test_a_pin_keeps_the_prompts_block_granular_tail(registry: PluginRegistry, when: str) -> None:
    """With ``block_granular_hits`` a store keeps the tokens past the last whole chunk as a tail
    record: a pin of the prompt pins it with the whole chunks, and unpin releases it."""
    tiers = [{"type": "cpu", "max_bytes": "64KiB", "pin_max_bytes": "50%", "request_pin_max_bytes": "50%"}]
    with make(registry, tiers=tiers, block_granular_hits=True, tenancy={"request_pins": True}) as engine:
        prompt = SYSTEM[:30]  # 3 whole chunks of 8, then 6 tokens: the tail is cut at the block end 28
        caches = random_caches(LAYOUT, 16)
        if when == "before_store":
            assert engine.pin(prompt) == PinReport(chunks=0, bytes=0, refused=0, missing=4)
        info = RequestInfo(overrides={"pin_request": True}) if when == "request" else None
        engine.store(prompt, caches, torch.arange(30), request=info)
        assert engine.lookup(prompt) == 28
        if when == "after_store":
            pinned = engine.pin(prompt)
            assert (pinned.chunks, pinned.refused, pinned.missing) == (4, 0, 0)  # three chunks and the tail
        for i in range(200):  # fills the tier many times over
            engine.store(one_off(i), caches, torch.arange(32))
            engine.flush()  # a store the full queue cannot take is shed: each must land
        assert engine.lookup(one_off(0)) == 0
        assert engine.lookup(prompt) == 28  # the tail still hits, not only the whole chunks (24)
        if when != "request":
            assert engine.unpin(prompt).chunks == 4
            for i in range(200):
                engine.store(one_off(1000 + i), caches, torch.arange(32))
                engine.flush()
            assert engine.lookup(prompt) == 0


def test_unpin_counts_only_the_chunks_a_store_writes(registry: PluginRegistry) -> None:
    """Without ``save_unfull_chunk`` a store never writes the partial last chunk: unpin does not
    count it missing, yet releases it where a request's own ``save_unfull_chunk`` pinned it."""
    tiers = [{"type": "cpu", "max_bytes": "64KiB", "pin_max_bytes": "50%"}]
    with make(registry, tiers=tiers) as engine:
        prompt = SYSTEM[:30]  # 3 whole chunks of 8, then 6 tokens
        engine.store(prompt, random_caches(LAYOUT, 16), torch.arange(30))
        pinned = engine.pin(prompt)
        assert (pinned.chunks, pinned.tokens, pinned.missing) == (3, 24, 0)
        assert engine.unpin(prompt) == PinReport(chunks=3, bytes=pinned.bytes, missing=0, tokens=24)
        partial = RequestInfo(overrides={"save_unfull_chunk": True})
        engine.store(prompt, random_caches(LAYOUT, 16), torch.arange(30), request=partial)
        assert (engine.pin(prompt, request=partial).chunks, engine.lookup(prompt, request=partial)) == (4, 30)
        released = engine.unpin(prompt)  # the engine's own setting: the partial chunk is released too
        assert (released.chunks, released.tokens, released.missing) == (4, 30, 0)
