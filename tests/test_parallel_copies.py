"""Copies split across copy threads: the same bytes as one thread, every copy done before a call returns."""

from __future__ import annotations

import threading
import time
from functools import partial

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import load_config, slots_from_block_ids
from kvplug.core.engine.parallel_copies import ParallelCopies
from kvplug.errors import ConfigError
from kvplug.testing import gather_chunk

NUM_BLOCKS = 80
TOKENS = 40  # five chunks of 8


def _slots(layout, blocks: list[int]) -> torch.Tensor:
    return slots_from_block_ids(blocks, layout.block_size, TOKENS)


def _read(engine, caches, slots: torch.Tensor) -> torch.Tensor:
    out = torch.empty(engine.layout.chunk_shape(slots.numel()), dtype=engine.layout.dtype)
    gather_chunk(engine.connector, caches, slots, out)
    return out.view(torch.uint8)


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
@pytest.mark.parametrize("layerwise", [False, True])
def test_parallel_store_and_retrieve_write_the_same_bytes_as_one_thread(
    kind: str, layerwise: bool, make_engine
) -> None:
    layout = LAYOUTS[kind]
    source = random_caches(layout, NUM_BLOCKS, seed=1)
    src = _slots(layout, list(range(NUM_BLOCKS // 2)))
    dst = _slots(layout, list(range(NUM_BLOCKS // 2, NUM_BLOCKS))[::-1])
    results = []
    for threads in (1, 3):
        engine = make_engine(layout, copy_threads=threads)
        tokens = list(range(100, 100 + TOKENS))
        if layerwise:
            storing = engine.store_layerwise(tokens, source, src)
            assert list(storing) == list(range(layout.num_layers))
        else:
            assert engine.store(tokens, source, src) == TOKENS
        target = random_caches(layout, NUM_BLOCKS, seed=2)
        if layerwise:
            loading = engine.retrieve_layerwise(tokens, target, dst)
            assert list(loading) == list(range(layout.num_layers))
            loaded = loading.loaded_mask
        else:
            loaded = engine.retrieve(tokens, target, dst)
        assert bool(loaded.all())
        assert torch.equal(_read(engine, target, dst), _read(engine, source, src))
        results.append(torch.cat([t.flatten().view(torch.uint8) for t in _flat(target)]))
    assert torch.equal(results[0], results[1])  # the rest of the cache is untouched alike


def _flat(caches) -> list[torch.Tensor]:
    return [t for cache in caches for t in (cache if isinstance(cache, tuple | list) else (cache,))]


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_engine_gathers_and_writes_on_copy_threads(layerwise: bool, make_engine) -> None:
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout, copy_threads=2)
    threads: dict[str, set[str]] = {"gather_layer": set(), "scatter_layer": set()}
    for name, seen in threads.items():
        copy = getattr(engine.connector, name)

        def recording(*args: object, copy=copy, seen=seen) -> None:
            seen.add(threading.current_thread().name)
            copy(*args)

        setattr(engine.connector, name, recording)
    caches = random_caches(layout, NUM_BLOCKS)
    slots = _slots(layout, list(range(NUM_BLOCKS // 2)))
    tokens = list(range(TOKENS))
    assert engine.store(tokens, caches, slots) == TOKENS
    if layerwise:
        loading = engine.retrieve_layerwise(tokens, caches, slots)
        assert list(loading) == list(range(layout.num_layers))
    else:
        assert bool(engine.retrieve(tokens, caches, slots).all())
    for seen in threads.values():
        # the caller only waits (that shares run at once: test_copies_run_at_the_same_time)
        assert seen and all(name.startswith("kvplug-copy") for name in seen), seen


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_copy_threads_write_the_inference_tensors_of_an_engine_in_inference_mode(kind: str, make_engine) -> None:
    # vLLM runs the connector inside torch.inference_mode(), which is per thread.
    layout = LAYOUTS[kind]
    engine = make_engine(layout, copy_threads=2)
    with torch.inference_mode():
        source = random_caches(layout, NUM_BLOCKS, seed=1)
        src = _slots(layout, list(range(NUM_BLOCKS // 2)))
        tokens = list(range(100, 100 + TOKENS))
        assert engine.store(tokens, source, src) == TOKENS
        target = random_caches(layout, NUM_BLOCKS, seed=2)
        dst = _slots(layout, list(range(NUM_BLOCKS // 2, NUM_BLOCKS)))
        assert bool(engine.retrieve(tokens, target, dst).all())
        assert torch.equal(_read(engine, target, dst), _read(engine, source, src))


def test_copies_run_at_the_same_time() -> None:
    copies = ParallelCopies(2)
    barrier = threading.Barrier(2, timeout=10)  # passes only when both copies are running at once
    done: list[int] = []
    copies.run([lambda: done.append(barrier.wait()), lambda: done.append(barrier.wait())])
    assert sorted(done) == [0, 1]
    copies.close()


def test_an_error_is_raised_only_after_every_other_copy_finished() -> None:
    copies = ParallelCopies(3)
    finished = threading.Event()

    def slow() -> None:
        time.sleep(0.2)
        finished.set()

    def failing() -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="copy failed"):
        copies.run([failing, slow, lambda: None])
    assert finished.is_set()
    copies.close()


def test_every_copy_runs_once_whatever_the_split() -> None:
    copies = ParallelCopies(4)
    for count in range(0, 11):
        ran = [0] * count
        copies.run([partial(_bump, ran, i) for i in range(count)])
        assert ran == [1] * count
    copies.close()


def _bump(counts: list[int], index: int) -> None:
    counts[index] += 1


def test_copy_threads_must_be_positive_or_auto() -> None:
    assert load_config(engine_extra={"kvplug.copy_threads": "auto"}, env={}).config.copy_threads == "auto"
    assert load_config(engine_extra={"kvplug.copy_threads": 2}, env={}).config.copy_threads == 2
    with pytest.raises(ConfigError, match="copy_threads"):
        load_config(engine_extra={"kvplug.copy_threads": 0}, env={})


def test_copy_threads_copy_on_one_intra_op_thread_and_leave_the_callers_alone() -> None:
    # A copy thread with an OpenMP team of its own slows the engine thread's small
    # parallel ops (libgomp stops spinning once it manages more threads than cores).
    caller_threads = torch.get_num_threads()
    seen: dict[str, int] = {}

    def record() -> None:
        seen[threading.current_thread().name] = torch.get_num_threads()

    copies = ParallelCopies(2)
    try:
        copies.run([record, record])
    finally:
        copies.close()
    assert list(seen) and all(name.startswith("kvplug-copy") for name in seen)  # the caller copies nothing
    assert set(seen.values()) == {1}
    assert torch.get_num_threads() == caller_threads
    # torch's process-wide default is untouched: a thread that starts using torch now gets it
    later = threading.Thread(target=record, name="started-later")
    later.start()
    later.join()
    assert seen["started-later"] == caller_threads
