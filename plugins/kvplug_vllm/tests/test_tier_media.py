"""The connector tells tiers apart by their declared ``medium``, never by their names: a
third-party in-memory tier is served as fast as ``cpu`` by the scheduler's lookups and is
emptied by vLLM's prefix cache reset; a tier that declares nothing counts as remote.

No engine: a real CacheEngine with real tiers, the scheduler side's lookup path
(``get_num_new_matched_tokens`` over a direct lookup) and the worker's ``reset_cache``.
vLLM's config and request objects are plain data here, as in test_units.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import kvplug
from kvplug import (
    Buffer,
    CacheEngine,
    ChunkLocation,
    EngineControl,
    Fingerprint,
    KVLayout,
    PluginRegistry,
    RequestInfo,
    StorageTier,
    TierStats,
    load_config,
    merge_locations,
    slots_from_block_ids,
)
from kvplug_vllm.layout import VLLM_CPU
from kvplug_vllm.lookup import LocalWorker, register_local, unregister_local
from kvplug_vllm.scheduler import SchedulerSide
from kvplug_vllm.settings import ConnectorSettings, resets
from kvplug_vllm.worker import WorkerSide

LAYOUT = KVLayout(VLLM_CPU, num_layers=2, block_size=32, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
PROMPT = list(range(3, 203))  # 3 whole chunks of 64


class _DictTier(StorageTier):
    """A third-party tier keeping values in a dict of this process."""

    def __init__(self, config: Any, context: kvplug.TierContext) -> None:
        super().__init__(config, context)
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get(self, keys: Sequence[str]) -> list[Buffer | None]:
        with self._lock:
            return [self._values.get(key) for key in keys]

    def put(self, items: Sequence[tuple[str, Buffer]]) -> None:
        with self._lock:
            self._values.update((key, bytes(value)) for key, value in items)

    def remove(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._values.pop(key, None)

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(bytes_used=sum(map(len, self._values.values())), items=len(self._values))

    def close(self) -> None:
        pass


class RamTier(_DictTier):
    name = "ram"
    medium = "memory"


class LegacyTier(_DictTier):
    """Written against kvplug 0.2: declares no medium."""

    name = "legacy"


class ThirdParty:
    @kvplug.hookimpl
    def kvplug_storage_tiers(self) -> list[type]:
        return [RamTier, LegacyTier]


@pytest.fixture
def registry() -> PluginRegistry:
    registry = PluginRegistry(plugin_filter="disk")
    assert registry.register(ThirdParty(), "third-party")
    return registry


@pytest.fixture
def engine_and_control(registry: PluginRegistry, tmp_path: Path) -> Iterator[tuple[CacheEngine, EngineControl]]:
    """The engine, and the control target a worker keeps from its start (its journal saw the stores)."""
    extra = {
        "kvplug.chunk_size": 64,
        "kvplug.store.queue.mode": "sync",
        "kvplug.tiers": [
            {"type": "ram"},
            {"type": "legacy"},
            {"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "64MiB"},
        ],
    }
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="unit"), registry=registry) as cache:
        control = EngineControl(cache)
        caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        cache.store(PROMPT, caches, slots_from_block_ids(list(range(1, 16)), 32, len(PROMPT)))
        cache.chain.flush()
        yield cache, control
        control.close()


@pytest.fixture
def engine(engine_and_control: tuple[CacheEngine, EngineControl]) -> CacheEngine:
    return engine_and_control[0]


def worker_of(engine: CacheEngine, control: EngineControl, **settings: Any) -> Any:
    """What WorkerSide.reset_cache reads of a worker."""
    return SimpleNamespace(engine=engine, target=control, settings=ConnectorSettings(**settings))


def tier(engine: CacheEngine, name: str) -> StorageTier:
    return next(t for t in engine.chain.tiers if t.name == name)


def scheduler(
    engine: CacheEngine, reset: Callable[[], int] = lambda: 0, settings: ConnectorSettings | None = None
) -> Iterator[SchedulerSide]:
    key = (f"unit-media-{id(engine):x}", 0, 0)
    register_local(key, LocalWorker(engine, reset))
    vllm_config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True),
        cache_config=SimpleNamespace(block_size=32),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        kv_events_config=None,
    )
    side = SchedulerSide(vllm_config, settings or ConnectorSettings(lookup_channel="direct"), engine.config, key)
    try:
        yield side
    finally:
        side.shutdown()
        unregister_local(key)


@pytest.fixture
def side(engine: CacheEngine) -> Iterator[SchedulerSide]:
    yield from scheduler(engine)


def request(request_id: str) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        all_token_ids=PROMPT,
        num_prompt_tokens=len(PROMPT),
        num_tokens=len(PROMPT),
        kv_transfer_params=None,
        mm_features=None,
        lora_request=None,
        cache_salt=None,
    )


#: What vLLM's KVCacheManager.get_blocks returns, as far as the scheduler side reads it.
BLOCKS = SimpleNamespace(get_block_ids=lambda: (list(range(1, 8)),))
HIT_FIGURES = ("lookups", "lookup_tokens", "hit_tokens", "vllm_cached_tokens")


def answer(side: SchedulerSide, req: Any, num_computed: int) -> tuple[int | None, bool]:
    """What ``get_num_new_matched_tokens`` answers once its background lookup (if any) is done."""
    deadline = time.monotonic() + 10
    while (found := side.get_num_new_matched_tokens(req, num_computed))[0] is None and time.monotonic() < deadline:
        time.sleep(0.005)  # vLLM asks again next step
    return found


def hit_figures(stats: Any) -> dict[str, int]:
    data = stats.data if stats is not None else {}
    return {k: v for k, v in data.items() if k in HIT_FIGURES or k.startswith("hit_tokens_tier.")}


def test_a_request_vllm_asks_about_again_is_counted_once_when_admitted(side: SchedulerSide) -> None:
    # vLLM asks again, step after step, about a waiting request it could not schedule yet.
    for _ in range(3):
        assert side.get_num_new_matched_tokens(request("r-wait"), 0) == (192, False)
    waiting = side.get_kv_connector_stats()
    assert waiting is not None and waiting.data["lookup_us"] > 0  # the time spent is real
    assert not any(hit_figures(waiting).values())  # nothing found is counted before admission
    side.update_state_after_alloc(request("r-wait"), BLOCKS, 192)
    expected = {"lookups": 1, "lookup_tokens": 200, "hit_tokens": 192, "vllm_cached_tokens": 0}
    assert hit_figures(side.get_kv_connector_stats()) == {**expected, "hit_tokens_tier.0:ram": 192}
    assert hit_figures(side.totals) == {**expected, "hit_tokens_tier.0:ram": 192}


def test_a_hit_partly_in_vllms_prefix_cache_counts_only_the_rest_by_tier(
    engine: CacheEngine, side: SchedulerSide
) -> None:
    last = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo()) if k.end == 192]
    # chunks [0, 128) in ram, [128, 192) only in legacy (disk, which answers inline, would hold it too)
    tier(engine, "ram").remove(last)
    tier(engine, "disk").remove(last)
    # vLLM's own prefix cache computed 96 tokens: kvplug adds 32 from ram and 64 from legacy.
    assert answer(side, request("r-part"), 96) == (96, True)  # legacy: remote, background
    side.update_state_after_alloc(request("r-part"), BLOCKS, 96)
    assert hit_figures(side.get_kv_connector_stats()) == {
        "lookups": 1,
        "lookup_tokens": 200,
        "hit_tokens": 96,
        "vllm_cached_tokens": 96,
        "hit_tokens_tier.0:ram": 32,
        "hit_tokens_tier.1:legacy": 64,
    }


def test_a_lookup_says_the_medium_of_each_chunks_tier(engine: CacheEngine) -> None:
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    assert engine.locate(PROMPT) == [ChunkLocation("memory", "ram", 64)] * 3
    tier(engine, "ram").remove(keys[:1])
    tier(engine, "legacy").remove(keys[1:2])
    tier(engine, "ram").remove(keys[1:2])  # declares no medium: remote; disk: its own
    assert [(loc.medium, loc.tier) for loc in engine.locate(PROMPT)] == [
        ("remote", "legacy"),
        ("disk", "disk"),
        ("memory", "ram"),
    ]


def test_a_prefix_in_a_third_party_memory_tier_loads_before_the_step(engine: CacheEngine, side: SchedulerSide) -> None:
    assert side.get_num_new_matched_tokens(request("r1"), 0) == (192, False)  # False: not in the background
    side.update_state_after_alloc(request("r1"), BLOCKS, 192)
    stats = side.get_kv_connector_stats()
    assert stats is not None and stats.data["hit_tokens_tier.0:ram"] == 192


@pytest.mark.parametrize("gone", [["ram"], ["ram", "legacy"]], ids=["legacy-tier", "disk-tier"])
def test_a_prefix_only_in_slower_media_loads_in_the_background(
    engine: CacheEngine, side: SchedulerSide, gone: list[str]
) -> None:
    keys = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo())]
    for name in gone:
        tier(engine, name).remove(keys)
    assert answer(side, request("r2"), 0) == (192, True)


def test_tensor_parallel_answers_merge_to_the_slowest_medium() -> None:
    ram, cpu, disk = (ChunkLocation(m, n, 64) for m, n in (("memory", "ram"), ("memory", "cpu"), ("disk", "disk")))
    assert merge_locations([[ram, ram, disk], [cpu, disk, ram, ram]]) == [cpu, disk, disk]
    assert merge_locations([[ram], [ChunkLocation("remote", "legacy", 64)]]) == [ChunkLocation("remote", "legacy", 64)]


def test_the_prefix_cache_reset_empties_the_memory_tiers_and_keeps_the_others(
    engine_and_control: tuple[CacheEngine, EngineControl],
) -> None:
    engine, control = engine_and_control
    keys = [k for k in engine.chunk_keys(PROMPT, RequestInfo()) if k.end % 64 == 0]  # the 3 stored chunks
    # reset_tiers: default; one KV cache group
    assert WorkerSide.reset_cache(worker_of(engine, control)) == len(keys)
    held = {t.name: t.contains([k.key for k in keys]) for t in engine.chain.tiers}
    assert held == {"ram": [False] * 3, "legacy": [True] * 3, "disk": [True] * 3}


def test_vllms_prefix_cache_reset_reaches_the_worker_in_this_process(
    engine_and_control: tuple[CacheEngine, EngineControl],
) -> None:
    # The scheduler side finds the worker's engine and its reset in one registry.
    engine, control = engine_and_control
    keys = [k for k in engine.chunk_keys(PROMPT, RequestInfo()) if k.end % 64 == 0]
    worker = worker_of(engine, control)
    for side in scheduler(engine, reset=lambda: WorkerSide.reset_cache(worker)):
        assert side.reset_cache()
    held = {t.name: t.contains([k.key for k in keys]) for t in engine.chain.tiers}
    assert held == {"ram": [False] * 3, "legacy": [True] * 3, "disk": [True] * 3}


def test_reset_tiers_names_the_tiers_to_empty(engine: CacheEngine) -> None:
    named = ["legacy"]
    assert [t.name for t in engine.chain.tiers if resets(t, named)] == ["legacy"]
    assert [t.name for t in engine.chain.tiers if resets(t, [])] == []
    assert [t.name for t in engine.chain.tiers if resets(t, None)] == ["ram"]


def test_a_tier_declaring_an_unknown_medium_is_refused() -> None:
    class SsdTier(RamTier):
        name = "ssd"
        medium = "ssd"  # type: ignore[assignment]

    class Plugin:
        @kvplug.hookimpl
        def kvplug_storage_tiers(self) -> list[type]:
            return [SsdTier]

    registry = PluginRegistry(load_entry_points=False)
    registry.register(Plugin(), "ssd-plugin")
    assert "ssd" not in registry.storage_tiers()  # the plugin is refused; the others still load
    [error] = registry.load_errors
    assert "plugin 'ssd-plugin'" in str(error)
    assert "its storage tier 'ssd' declares medium 'ssd'; a tier's medium is one of memory, disk, remote" in str(error)


def test_the_prefix_cache_reset_leaves_what_other_engines_wrote_to_a_shared_memory_tier(tmp_path: Path) -> None:
    """``shm`` is of medium memory, so vLLM's reset empties it by default, but other engines of
    the host write it too: the reset removed every chunk the worker had loaded from there,
    theirs included. Now, as ``kvplug ctl clear``: everything from the private ``cpu`` tier,
    from ``shm`` only what this worker's writes put there."""
    registry = PluginRegistry(plugin_filter="cpu,disk")
    shm = {"type": "shm", "path": str(tmp_path / "shm"), "max_bytes": "64MiB"}
    settings = {"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync"}
    other_config = load_config(engine_extra={**settings, "kvplug.tiers": [shm]}, env={}, registry=registry).config
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, shm]
    config = load_config(engine_extra={**settings, "kvplug.tiers": tiers}, env={}, registry=registry).config
    fingerprint = Fingerprint.for_layout(LAYOUT, model_id="unit")
    theirs_prompt = list(range(500, 700))
    slots = slots_from_block_ids(list(range(1, 16)), 32, len(PROMPT))
    with (
        CacheEngine(other_config, LAYOUT, fingerprint, registry=registry) as other,
        CacheEngine(config, LAYOUT, fingerprint, registry=registry) as engine,
    ):
        control = EngineControl(engine)
        caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        other.store(theirs_prompt, caches, slots)
        other.flush()
        assert int(engine.retrieve(theirs_prompt, caches, slots).sum()) == 192  # loaded, promoted into cpu
        engine.store(PROMPT, caches, slots)
        engine.flush()
        theirs = [k.key for k in engine.chunk_keys(theirs_prompt, RequestInfo()) if k.end % 64 == 0]
        ours = [k.key for k in engine.chunk_keys(PROMPT, RequestInfo()) if k.end % 64 == 0]
        cpu, shared = engine.chain.tiers
        assert cpu.contains(theirs + ours) == [True] * 6 and shared.contains(theirs + ours) == [True] * 6

        assert WorkerSide.reset_cache(worker_of(engine, control)) == 6
        assert cpu.contains(theirs + ours) == [False] * 6  # this process's memory: all of it
        assert shared.contains(theirs) == [True] * 3  # the other engine's records stay
        assert shared.contains(ours) == [False] * 3
        control.close()


def test_the_prefix_cache_reset_of_a_disk_tier_cancels_its_queued_writes(
    registry: PluginRegistry, tmp_path: Path
) -> None:
    """A chunk whose disk write is still queued (the disk is slow: its ``put`` is held at a
    gate) when the reset comes is not written after it."""
    tiers = [{"type": "ram"}, {"type": "disk", "path": str(tmp_path / "disk"), "queue": {"mode": "async"}}]
    extra = {"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync", "kvplug.tiers": tiers}
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    second_prompt = list(range(1000, 1200))
    slots = slots_from_block_ids(list(range(1, 16)), 32, len(PROMPT))
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="unit"), registry=registry) as engine:
        control = EngineControl(engine)
        disk = tier(engine, "disk")
        gate, entered = threading.Event(), threading.Event()
        real_put = disk.put

        def slow_put(items: Any) -> None:
            entered.set()
            assert gate.wait(60), "the test never opened the gate"
            real_put(items)

        disk.put = slow_put  # type: ignore[method-assign]
        caches = [torch.randn(16, 2, 32, 128).to(torch.bfloat16) for _ in range(2)]
        engine.store(PROMPT, caches, slots)
        assert entered.wait(30)  # the first prompt's disk write is held; the second queues behind it
        engine.store(second_prompt, caches, slots)
        keys = [k.key for prompt in (PROMPT, second_prompt) for k in engine.chunk_keys(prompt, RequestInfo())]
        opener = threading.Timer(0.3, gate.set)  # the held write lands while the reset runs
        opener.start()
        try:
            WorkerSide.reset_cache(worker_of(engine, control, reset_tiers=["ram", "disk"]))
        finally:
            opener.join()
        engine.flush()
        assert disk.contains(keys) == [False] * len(keys), "a reset chunk came back from the write queue"
        assert tier(engine, "ram").contains(keys) == [False] * len(keys)
        control.close()
