"""The ``cuda`` connector inside a CacheEngine, its choice by ``auto``, and its staging path."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import DEVICE, VLLM_FLASH, VLLM_MLA, caches_same_bits, make_caches, same_bits

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config
from kvplug.builtins.torch_connector import TorchConnector
from kvplug.errors import ConfigError, PinnedPoolExhaustedError
from kvplug.testing import gather_chunk
from kvplug_cuda import CudaConnector

LAYOUT = KVLayout(VLLM_FLASH, num_layers=3, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def make_engine(registry, connector: dict, **settings: object) -> CacheEngine:
    extra = {"kvplug.store.queue.mode": "sync", "kvplug.chunk_size": 8, "kvplug.connector": connector}
    extra.update({f"kvplug.{key}": value for key, value in settings.items()})
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="cuda-test"), registry=registry)


def _store_and_retrieve(engine: CacheEngine, source: list, tokens: list[int]) -> tuple[list, torch.Tensor]:
    """Store ``tokens`` layer by layer out of ``source``, then load them at other slots of fresh caches."""
    store_slots = torch.tensor([21, 22, 23, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11, 16], device=DEVICE)[
        : len(tokens)
    ]
    storing = engine.store_layerwise(tokens, source, store_slots)
    assert list(storing) == list(range(LAYOUT.num_layers))
    target = [torch.zeros_like(cache) for cache in source]
    load_slots = torch.arange(len(tokens), device=DEVICE).flip(0) + 3
    loading = engine.retrieve_layerwise(tokens, target, load_slots)
    assert loading.num_loaded_tokens == 16  # two whole chunks of 8; the tail is not stored
    assert list(loading) == list(range(LAYOUT.num_layers))
    return target, loading.loaded_mask


def test_engine_round_trip_matches_the_torch_connector(registry) -> None:
    source = make_caches(LAYOUT, 8, torch.Generator().manual_seed(7))
    tokens = list(range(100, 120))
    with (
        make_engine(registry, {"type": "cuda"}) as cuda_engine,
        make_engine(registry, {"type": "torch"}) as torch_engine,
    ):
        assert isinstance(cuda_engine.connector, CudaConnector)
        got, got_mask = _store_and_retrieve(cuda_engine, source, tokens)
        want, want_mask = _store_and_retrieve(torch_engine, source, tokens)
        assert torch.equal(got_mask, want_mask) and int(got_mask.sum()) == 16
        assert caches_same_bits(got, want)
        assert any(bool(c.view(torch.uint8).any()) for c in got)
        stats = cuda_engine.connector.stats()
        assert stats.gathers == 2 * LAYOUT.num_layers and stats.scatters == 2 * LAYOUT.num_layers
        assert stats.pool.in_use_bytes == 0  # synchronize released every staging buffer
        # Pinned frames (and DMA straight into them) only where there is a device to pin for.
        assert cuda_engine.frame_pool.stats().pinned == torch.cuda.is_available()


def test_connector_options_are_validated(registry) -> None:
    with pytest.raises(ConfigError, match="pool_timeout_s"):
        make_engine(registry, {"type": "cuda", "pool_timeout_s": 0})
    # An infinite wait is not a timeout.
    for name in ("pool_timeout_s", "copy_timeout_s"):
        with pytest.raises(ConfigError, match=rf"connector.{name}: .*finite.*less than or equal to 3600"):
            make_engine(registry, {"type": "cuda", name: float("inf")})
    with make_engine(registry, {"type": "cuda", "pinned_pool_bytes": "1MiB"}) as engine:
        assert engine.connector.pool.capacity_bytes == 1024**2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback on a machine without CUDA")
def test_auto_falls_back_to_torch_without_cuda(registry, caplog) -> None:
    assert CudaConnector.is_available() is False
    assert CudaConnector.priority > getattr(TorchConnector, "priority", 0)
    with caplog.at_level(logging.INFO, logger="kvplug.engine"), make_engine(registry, {"type": "auto"}) as engine:
        assert type(engine.connector) is TorchConnector
    assert "connector auto: chose 'torch'" in caplog.text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_explicit_cuda_without_cuda_or_interpreter_says_what_to_do() -> None:
    code = textwrap.dedent(
        """
        import torch
        from kvplug import KVLayout, PagedFormat
        from kvplug.errors import ConnectorError
        from kvplug_cuda import CudaConnector
        layout = KVLayout(PagedFormat("vllm_mla", ("block", "token", "dim"), latent=True), 1, 4, 1, 8, torch.float16)
        try:
            CudaConnector(CudaConnector.Config(), layout)
        except ConnectorError as exc:
            print(exc)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, check=False, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "needs a CUDA device" in result.stdout and "{type: auto}" in result.stdout


def test_a_full_pool_finishes_earlier_transfers_instead_of_failing(registry) -> None:
    """Eight layers of 64 KiB staged through a 128 KiB pool without synchronize in between:
    finished transfers hand their buffers back, and the pool stays within its budget."""
    layout = KVLayout(VLLM_MLA, num_layers=8, block_size=16, num_kv_heads=1, head_dim=512, dtype=torch.float32)
    caches = make_caches(layout, 3, torch.Generator().manual_seed(8))
    slots = torch.arange(32, device=DEVICE)
    connector = CudaConnector(CudaConnector.Config(pinned_pool_bytes=128 * 1024, pool_timeout_s=5), layout)
    got = torch.empty(layout.chunk_shape(32), dtype=layout.dtype)
    plan = connector.plan(slots)
    for layer, cache in enumerate(caches):
        connector.gather_layer(cache, plan, got[layer])
        assert connector.stats().pool.allocated_bytes <= 128 * 1024
    connector.synchronize()
    want = torch.empty_like(got)
    gather_chunk(TorchConnector(TorchConnector.Config(), layout), caches, slots, want)
    assert same_bits(got, want)
    assert connector.stats().pool.misses == 0


def test_a_chunk_layer_larger_than_the_pool_is_a_counted_miss() -> None:
    layout = KVLayout(VLLM_MLA, num_layers=1, block_size=16, num_kv_heads=1, head_dim=4096, dtype=torch.float32)
    caches = make_caches(layout, 1, torch.Generator().manual_seed(9))
    connector = CudaConnector(CudaConnector.Config(pinned_pool_bytes=64 * 1024), layout)
    out = torch.empty(layout.chunk_shape(16), dtype=layout.dtype)  # 256 KiB
    with pytest.raises(PinnedPoolExhaustedError, match="raise pinned_pool_bytes"):
        connector.gather_layer(caches[0], connector.plan(torch.arange(16, device=DEVICE)), out[0])
    stats = connector.stats()
    assert stats.pool.misses == 1 and stats.pool.in_use_bytes == 0 and stats.gathers == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_the_benchmark_exits_cleanly_without_a_gpu() -> None:
    from pathlib import Path

    script = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_cuda.py"
    result = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no CUDA device here" in result.stdout


def test_release_caches_forgets_addresses_and_copies_follow_new_caches() -> None:
    """vLLM's sleep mode unmaps the caches: after ``release_caches`` no table of the old ones is used."""
    connector = CudaConnector(CudaConnector.Config(), LAYOUT)
    old = make_caches(LAYOUT, num_blocks=6, generator=torch.Generator().manual_seed(3))
    slots = torch.arange(8, device=DEVICE) + 4
    chunk = torch.empty(LAYOUT.chunk_shape(8), dtype=LAYOUT.dtype, pin_memory=DEVICE.type == "cuda")
    connector.gather(old, slots, chunk)
    connector.synchronize()
    assert connector._tables  # the old caches' addresses are kept for reuse
    connector.release_caches()
    assert not connector._tables
    new = [torch.zeros_like(cache) for cache in old]
    before = [cache.clone() for cache in old]
    connector.scatter(new, slots, chunk)
    connector.synchronize()
    expected = [torch.zeros_like(cache) for cache in old]
    reference = TorchConnector(TorchConnector.Config(), LAYOUT)
    for layer, cache in enumerate(expected):
        reference.scatter_layer(cache, reference.plan(slots), chunk[layer])
    assert caches_same_bits(new, expected), "the scatter did not land in the new caches"
    assert caches_same_bits(old, before), "the scatter wrote the released caches"
