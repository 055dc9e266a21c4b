"""The frame pool recycles memory only once nothing refers to a frame any more."""

from __future__ import annotations

import gc

import torch

from kvplug.builtins.raw_serializer import RawSerializer
from kvplug.core.components import EmptyConfig
from kvplug.core.engine.frame_pool import GRANULARITY, FramePool


def test_frames_are_recycled_after_their_last_reference_dies() -> None:
    pool = FramePool(8 * GRANULARITY)
    frames = [pool.new_buffer(3000) for _ in range(4)]
    assert pool.stats().in_use == 4 * GRANULARITY
    views = [memoryview(f).toreadonly() for f in frames]
    del frames
    gc.collect()
    assert pool.stats().in_use == 4 * GRANULARITY  # the read-only views still hold them
    del views
    gc.collect()
    assert pool.stats().in_use == 0
    again = [pool.new_buffer(3000) for _ in range(4)]
    assert pool.stats().recycled == 4 and pool.stats().carved == 4 * GRANULARITY
    assert all(memoryview(f).nbytes == 3000 for f in again)


def test_a_full_pool_falls_back_to_fresh_memory() -> None:
    pool = FramePool(2 * GRANULARITY)
    frames = [pool.new_buffer(GRANULARITY) for _ in range(3)]
    assert isinstance(frames[2], bytearray) and pool.stats().fallbacks == 1
    assert FramePool(0).new_buffer(10) == bytearray(10)


def test_live_frames_never_share_memory_and_keep_their_bytes() -> None:
    pool = FramePool(64 * GRANULARITY)
    serializer = RawSerializer(EmptyConfig())
    sealed = []
    for value in range(20):
        frame, payload = serializer.allocate((100,), torch.float32, pool.new_buffer)
        payload.fill_(value)
        sealed.append(serializer.seal(frame))
        if value % 3 == 0:
            sealed.pop(0)  # drop one: its memory returns to the pool and is reused
            gc.collect()
    for data in sealed:
        tensor = serializer.loads(data)
        assert torch.equal(tensor, torch.full((100,), tensor[0].item()))
    assert pool.stats().recycled > 0
    assert len({int(serializer.loads(d)[0].item()) for d in sealed}) == len(sealed)


def test_a_pool_asked_to_pin_without_cuda_says_why_and_still_serves(caplog) -> None:
    pool = FramePool(4 * GRANULARITY, pin=True)
    frame = pool.new_buffer(100)
    memoryview(frame).cast("B")[:3] = b"abc"
    assert bytes(frame)[:3] == b"abc"
    if not torch.cuda.is_available():
        assert not pool.stats().pinned
        assert "frames stay pageable" in caplog.text


def test_the_engine_pins_its_frames_only_for_a_connector_that_wants_it(make_engine) -> None:
    from core_helpers import LAYOUTS

    engine = make_engine(LAYOUTS["vllm_flash"])
    assert not engine.connector.wants_pinned_frames()  # the torch connector on host memory
    assert not engine.frame_pool.stats().pinned


def test_frames_a_disk_store_wrote_come_back_once_written(tmp_path) -> None:
    """Neither the engine's store queue nor the disk tier's writer keeps the last batch it
    wrote (its frames) while it waits for the next."""
    from core_helpers import LAYOUTS, random_caches

    from kvplug import CacheEngine, Fingerprint, load_config
    from kvplug.core.plugins import PluginRegistry

    registry = PluginRegistry(plugin_filter="cpu,disk")
    layout = LAYOUTS["vllm_flash"]
    extra = {
        "kvplug": {
            "chunk_size": 8,
            "store": {"queue": {"mode": "async"}},
            "tiers": [{"type": "disk", "path": str(tmp_path)}],
        }
    }
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m"), registry=registry) as engine:
        engine.store(list(range(16)), random_caches(layout, 8), torch.arange(16))
        engine.flush()
        gc.collect()
        assert engine.lookup(list(range(16))) == 16
        assert engine.frame_pool.stats().in_use == 0
