"""What only a real GPU shows: pinned staging, the copy stream's overlap, deadlines, auto's choice.

Each test carries ``@pytest.mark.gpu`` and skips, saying why, where CUDA is absent.
Overlap is asserted as an ordering of events around a long ``torch.cuda._sleep``
standing in for the engine's compute, not as a timing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import VLLM_FLASH, gpu, make_caches, needs_cuda, same_bits

from kvplug import CacheEngine, Fingerprint, KVLayout, load_config
from kvplug.builtins.torch_connector import TorchConnector
from kvplug.errors import TransferTimeoutError
from kvplug_cuda import CudaConnector

pytestmark = [gpu, needs_cuda]

LAYOUT = KVLayout(VLLM_FLASH, num_layers=4, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
#: About half a second of GPU time: far longer than copying one 1 MiB layer over PCIe.
LONG_SLEEP_CYCLES = 10**9


def _setup(**options: object):
    caches = make_caches(LAYOUT, 64, torch.Generator().manual_seed(11), device=torch.device("cuda"))
    slots = torch.randperm(64, device="cuda")[:16].repeat_interleave(16) * 16 + torch.arange(16, device="cuda").repeat(
        16
    )
    connector = CudaConnector(CudaConnector.Config(**options), LAYOUT)
    chunk = torch.empty(LAYOUT.chunk_shape(256), dtype=LAYOUT.dtype)
    # warm up: compile the kernel, fill the pool with whole-chunk and per-layer buffers
    connector.gather(caches, slots, chunk)
    connector.scatter(caches, slots, chunk)
    plan = connector.plan(slots)
    for layer, cache in enumerate(caches):
        connector.gather_layer(cache, plan, chunk[layer])
        connector.scatter_layer(cache, plan, chunk[layer])
    connector.synchronize()
    torch.cuda.synchronize()
    return caches, slots, connector, chunk


def test_staging_buffers_are_pinned() -> None:
    _, _, connector, _ = _setup()
    buffer = connector.pool.acquire(1024)
    try:
        assert buffer.tensor.is_pinned()
    finally:
        connector.pool.release(buffer)


def test_loading_layer_l_plus_1_overlaps_compute_of_layer_l() -> None:
    caches, slots, connector, chunk = _setup()
    target = [torch.zeros_like(c) for c in caches]
    plan = connector.plan(slots)
    # The first transfer into a set of caches builds its addressing table, which waits for
    # the device once (an engine's caches are registered once, at start): not the step measured.
    connector.scatter_layer(target[1], plan, chunk[1])
    connector.synchronize()
    torch.cuda._sleep(LONG_SLEEP_CYCLES)  # the engine computing layer l on its stream
    compute_done = torch.cuda.Event()
    compute_done.record()
    connector.scatter_layer(target[1], plan, chunk[1])  # load layer l + 1
    copied = torch.cuda.Event()
    copied.record(connector.copy_stream(torch.device("cuda", torch.cuda.current_device())))
    copied.synchronize()
    assert not compute_done.query(), "the host->device copy waited for the engine's compute"
    torch.cuda.synchronize()
    connector.synchronize()
    want = [torch.zeros_like(c) for c in caches]
    reference = TorchConnector(TorchConnector.Config(), LAYOUT)
    reference.scatter_layer(want[1], reference.plan(slots), chunk[1])
    assert same_bits(target[1].cpu(), want[1].cpu())


def test_storing_layer_l_does_not_wait_for_compute_of_layer_l_plus_1() -> None:
    caches, slots, connector, _ = _setup()
    out = torch.empty(LAYOUT.chunk_shape(256), dtype=LAYOUT.dtype)
    plan = connector.plan(slots)
    connector.gather_layer(caches[0], plan, out[0])
    torch.cuda._sleep(LONG_SLEEP_CYCLES)  # the engine computing the next layer
    compute_done = torch.cuda.Event()
    compute_done.record()
    connector.synchronize()
    assert not compute_done.query(), "synchronize() waited for compute queued after the gather"
    torch.cuda.synchronize()
    want = torch.empty_like(out[0])
    reference = TorchConnector(TorchConnector.Config(), LAYOUT)
    reference.gather_layer(caches[0], reference.plan(slots), want)
    assert same_bits(out[0], want)


def test_a_stuck_copy_times_out_instead_of_hanging() -> None:
    caches, slots, connector, _ = _setup(copy_timeout_s=0.05)
    out = torch.empty(LAYOUT.chunk_shape(256), dtype=LAYOUT.dtype)
    with torch.cuda.stream(connector.copy_stream(torch.device("cuda", torch.cuda.current_device()))):
        torch.cuda._sleep(4 * LONG_SLEEP_CYCLES)  # the copy stream is busy for seconds
    connector.gather_layer(caches[0], connector.plan(slots), out[0])
    with pytest.raises(TransferTimeoutError, match="did not complete"):
        connector.synchronize()
    stats = connector.stats()
    assert stats.timeouts == 1 and stats.pool.in_use_bytes > 0  # the buffer is abandoned, not reused
    torch.cuda.synchronize()


def test_auto_picks_cuda_when_it_is_available() -> None:
    from kvplug.core.plugins import PluginRegistry

    registry = PluginRegistry(plugin_filter="cuda,cpu")
    config = load_config(
        engine_extra={"kvplug.store.queue.mode": "sync", "kvplug.connector": {"type": "auto"}},
        env={},
        registry=registry,
    ).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="gpu"), registry=registry) as engine:
        assert isinstance(engine.connector, CudaConnector)


def test_the_benchmark_runs_and_is_bit_exact() -> None:
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_cuda.py"
    result = subprocess.run(
        [sys.executable, str(script), "--layers", "4", "--iters", "3"],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bit-exact vs torch: True" in result.stdout


def test_pinned_frames_are_copied_to_and_from_directly() -> None:
    """The engine pins its frame pool for this connector: no staging buffer, no host copy."""
    from kvplug.core.plugins import PluginRegistry

    registry = PluginRegistry(plugin_filter="cuda,cpu")
    extra = {"kvplug.store.queue.mode": "sync", "kvplug.chunk_size": 256, "kvplug.connector": {"type": "cuda"}}
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    caches, slots, _, _ = _setup()
    tokens = list(range(256))
    fingerprint = Fingerprint.for_layout(LAYOUT, model_id="gpu-pinned")
    with CacheEngine(config, LAYOUT, fingerprint, registry=registry) as engine:
        assert engine.frame_pool.stats().pinned
        assert engine.store(tokens, caches, slots) == 256
        # The stored slots zeroed, every other byte as in caches: a whole-cache comparison then
        # checks both that they came back and that nothing else was written.
        target = [c.clone() for c in caches]
        for t in target:
            t.view(2, -1, LAYOUT.num_kv_heads, LAYOUT.head_dim)[:, slots] = 0
        assert bool(engine.retrieve(tokens, target, slots).all())
        stats = engine.connector.stats()
        assert stats.pool.acquires == 0, "a pinned frame went through a staging buffer"
        assert stats.gathers == stats.scatters == LAYOUT.num_layers
    torch.cuda.synchronize()
    assert all(same_bits(a.cpu(), b.cpu()) for a, b in zip(caches, target))
