"""vLLM's sleep mode (``unregister_kv_caches`` / ``restore_kv_caches``) over a real CacheEngine.

No engine: the worker is the part of ``WorkerSide`` the hooks read (its cache engine, its
caches by layer name); the connector methods are ``KVPlugConnector``'s own. While the caches
are unregistered no copy touches them (a load is a miss, a store is dropped); after a
restore with new tensors, loads land in those and stores read them. A weight reload
(:mod:`kvplug_vllm.weights`) refuses the same way, for good: a wake-up does not undo it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config, slots_from_block_ids
from kvplug.core.plugins import PluginRegistry
from kvplug_vllm.connector import KVPlugConnector
from kvplug_vllm.layout import VLLM_FLASH
from kvplug_vllm.sleep import AsleepConnector, CacheRemapError, CacheSleep
from kvplug_vllm.weights import WeightsReloadedConnector, weights_reloaded

LAYOUT = KVLayout(VLLM_FLASH, num_layers=2, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
TOKENS = list(range(100, 228))  # two chunks of 64
SLOTS = slots_from_block_ids([3, 0, 6, 1, 7, 2, 5, 4], 16, len(TOKENS))


def caches(seed: int | None = None) -> list[torch.Tensor]:
    """One vllm_flash layer cache per layer ([2, blocks, block_size, heads, dim]); zeros without a seed."""
    shape = (2, 8, 16, 2, 64)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.bfloat16) for _ in NAMES]
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).to(torch.bfloat16) for _ in NAMES]


def connectors() -> list[Any]:
    cuda_installed = "cuda" in PluginRegistry().kv_connectors() if importlib.util.find_spec("kvplug_cuda") else False
    reason = "kvplug-cuda is not installed here (its own session runs it under Triton's interpreter)"
    return ["torch", pytest.param("cuda", marks=pytest.mark.skipif(not cuda_installed, reason=reason))]


@pytest.fixture(params=connectors())
def engine(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[CacheEngine]:
    if request.param == "cuda" and not torch.cuda.is_available():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the cuda connector's kernels on CPU tensors
    extra = {"kvplug.chunk_size": 64, "kvplug.store.queue.mode": "sync", "kvplug.connector": {"type": request.param}}
    config = load_config(engine_extra=extra, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="sleep")) as cache_engine:
        assert cache_engine.connector.name == request.param
        yield cache_engine


def connector_of(engine: CacheEngine, registered: list[torch.Tensor]) -> Any:
    """A worker-role connector's state as the sleep hooks see it (the worker's registered caches)."""
    worker = SimpleNamespace(
        engine=engine, kv_caches=registered, layer_index={n: i for i, n in enumerate(NAMES)}, groups=None
    )
    return SimpleNamespace(_worker=worker, _sleep=CacheSleep())


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_no_copy_touches_unregistered_caches_and_restored_ones_are_used(engine: CacheEngine) -> None:
    source = caches(seed=1)
    assert engine.store(TOKENS, source, SLOTS) == len(TOKENS)
    old = caches()
    connector = connector_of(engine, list(old))
    worker = connector._worker
    assert engine.retrieve(TOKENS[:64], worker.kv_caches, SLOTS[:64]).all()  # the caches were in use
    for tensor in old:
        tensor.zero_()

    KVPlugConnector.unregister_kv_caches(connector)
    KVPlugConnector.unregister_kv_caches(connector)  # idempotent
    assert isinstance(engine.connector, AsleepConnector)
    # asleep: a load is a miss and writes nothing; a store is dropped and reads nothing
    assert not engine.retrieve(TOKENS, worker.kv_caches, SLOTS).any()
    other = list(range(900, 964))
    assert engine.store(other, worker.kv_caches, SLOTS[:64]) == 0
    assert engine.lookup(other) == 0
    assert all(not tensor.any() for tensor in old), "a copy wrote an unregistered cache"

    new = caches()
    KVPlugConnector.restore_kv_caches(connector, dict(zip(NAMES, new)))
    KVPlugConnector.restore_kv_caches(connector)  # idempotent, as vLLM calls it (no tensors)
    assert engine.connector.name == engine.config.connector.type
    assert all(worker.kv_caches[i] is new[i] for i in range(len(NAMES)))
    assert engine.retrieve(TOKENS, worker.kv_caches, SLOTS).all()
    for src, dst, stale in zip(source, new, old):
        assert same_bytes(dst, src), "the load did not land in the restored caches"
        assert not stale.any(), "the load wrote the caches unregistered before the sleep"
    # a store after the wake-up reads the restored caches
    for tensor in new:
        tensor.copy_(torch.randn(tensor.shape, generator=torch.Generator().manual_seed(2)))
    assert engine.store(other, worker.kv_caches, SLOTS[:64]) == 64
    back = caches()
    assert engine.retrieve(other, back, SLOTS[:64]).all()
    blocks = [3, 0, 6, 1]  # the blocks of SLOTS[:64]
    for restored, loaded in zip(new, back):
        assert same_bytes(loaded[:, blocks], restored[:, blocks])


def test_restored_caches_must_match_the_registered_ones(engine: CacheEngine) -> None:
    old = caches()
    connector = connector_of(engine, list(old))
    KVPlugConnector.unregister_kv_caches(connector)
    with pytest.raises(CacheRemapError, match="lack layer"):
        KVPlugConnector.restore_kv_caches(connector, {NAMES[0]: caches()[0]})
    smaller = [torch.zeros(2, 4, 16, 2, 64, dtype=torch.bfloat16) for _ in NAMES]
    with pytest.raises(CacheRemapError, match=rf"layer {NAMES[0]}: restored cache is \(2, 4, 16, 2, 64\)"):
        KVPlugConnector.restore_kv_caches(connector, dict(zip(NAMES, smaller)))
    assert connector._worker.kv_caches[0] is old[0]  # nothing replaced
    assert isinstance(engine.connector, AsleepConnector)  # still asleep: no copy reaches a cache
    KVPlugConnector.restore_kv_caches(connector)
    assert not isinstance(engine.connector, AsleepConnector)


def test_the_scheduler_side_ignores_the_hooks_and_sleep_mode_is_declared() -> None:
    scheduler_side = SimpleNamespace(_worker=None, _sleep=CacheSleep())
    KVPlugConnector.unregister_kv_caches(scheduler_side)  # type: ignore[arg-type]
    KVPlugConnector.restore_kv_caches(scheduler_side)  # type: ignore[arg-type]
    assert not scheduler_side._sleep.asleep
    assert KVPlugConnector.supports_sleep_mode(SimpleNamespace(kv_connector_extra_config={}))


def test_a_weight_reload_while_asleep_keeps_refusing_after_the_wake_up(engine: CacheEngine) -> None:
    source = caches(seed=1)
    assert engine.store(TOKENS, source, SLOTS) == len(TOKENS)
    connector = connector_of(engine, caches())
    worker = connector._worker
    worker.can_save = True
    KVPlugConnector.unregister_kv_caches(connector)
    weights_reloaded(worker)  # RL's order: sleep, new weights in place, wake up
    KVPlugConnector.restore_kv_caches(connector)
    assert isinstance(engine.connector, WeightsReloadedConnector) and not worker.can_save
    # the old weights' KV: a load writes nothing (vLLM recomputes), a store is dropped
    assert not engine.retrieve(TOKENS, worker.kv_caches, SLOTS).any()
    assert all(not tensor.any() for tensor in worker.kv_caches)
    assert engine.store(list(range(900, 964)), source, SLOTS[:64]) == 0
    KVPlugConnector.unregister_kv_caches(connector)  # a later sleep and wake-up: still refused
    KVPlugConnector.restore_kv_caches(connector)
    assert isinstance(engine.connector, WeightsReloadedConnector)
