"""A request whose synchronous load failed stores nothing until vLLM has rolled it back.

vLLM's async scheduling (its default on GPUs) and pipeline parallelism schedule step N+1
before they have step N's output: a long prompt's next prefill chunk runs on top of blocks
whose load failed in step N, before vLLM rolls the request back to the first of them. Its KV
must not be stored: the chunks would keep the prompt's keys, and a later request would load
KV computed from blocks that never held this prompt's KV.

No vLLM engine: the worker side over a real CacheEngine (cpu tier) and real caches, fed the
metadata the scheduler side builds for those steps (``RequestMeta.epoch`` counts rollbacks),
and the scheduler side counting a rollback.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from worker_steps import BLOCKS, PROMPT, StepDriver, stored, sync_engine

from kvplug import CacheEngine
from kvplug_vllm.metadata import LoadSpec, RequestMeta


@pytest.fixture
def engine() -> Iterator[CacheEngine]:
    with sync_engine("failed-load-stores") as cache:
        yield cache


def test_steps_scheduled_before_vllm_saw_the_failed_load_store_nothing(engine: CacheEngine) -> None:
    driver = StepDriver(engine, "failed-load")  # 2 chunks stored; the lookups saw 4
    step, worker = driver.step, driver.worker
    try:
        # step N: load 256 tokens (only 128 still there), compute [256, 320)
        load = LoadSpec(num_computed=0, num_hit=256, num_external=256)
        assert step(RequestMeta("r", PROMPT, BLOCKS, load=load, save_start=256, save_end=320)) == {12, 13, 14, 15}
        # step N+1, scheduled before vLLM had step N's output: the next chunk, on top of blocks 12-15
        assert step(RequestMeta("r", PROMPT, BLOCKS, save_start=320, save_end=384)) == set()
        assert stored(engine) == [True, True] + [False] * 6
        # vLLM rolled it back to token 128: what it recomputes from there is stored
        assert step(RequestMeta("r", PROMPT, BLOCKS, save_start=128, save_end=192, epoch=1)) == set()
        assert stored(engine) == [True, True, True] + [False] * 5
        assert worker.results._poisoned == {}
        # a request that finishes before vLLM rolled it back leaves nothing behind
        assert step(RequestMeta("s", PROMPT, BLOCKS, load=load)) == {14, 15}  # chunk 2 is back
        assert "s" in worker.results._poisoned
        step(RequestMeta("r", PROMPT, BLOCKS, epoch=1), finished=frozenset({"s"}))  # the next step names it finished
        assert worker.results._poisoned == {}
    finally:
        driver.close()
