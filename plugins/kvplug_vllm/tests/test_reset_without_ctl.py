"""vLLM's prefix cache reset empties kvplug's in-memory tiers even where the worker's control
socket (``kvplug ctl``) cannot start: a reset that kept the chunks would serve KV computed
before it (old weights after a weight update) to the requests after it.

No engine: ``WorkerSide`` over vLLM's config as plain data (test_kernel_blocks.py's), its
socket folder a real private folder whose path is too long for a unix socket, its chunks
stored by its real cache engine.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_kernel_blocks import register
from vllm.distributed import parallel_state

from kvplug import slots_from_block_ids


@pytest.fixture
def long_socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private socket folder (``KVPLUG_LOOKUP_DIR``) whose sockets' paths are longer than a
    unix socket takes (about 108 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="kvlong-"))
    folder = root / ("x" * 120)
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("KVPLUG_LOOKUP_DIR", str(folder))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(world_size=1, cpu_group=None))
    yield folder
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.usefixtures("long_socket_dir")
def test_a_reset_empties_the_memory_tier_of_a_worker_without_a_control_socket(
    caplog: pytest.LogCaptureFixture,
) -> None:
    worker = register(64, 64)
    try:
        assert worker.control is None and "kvplug ctl is not available" in caplog.text
        engine = worker.engine
        assert engine is not None
        tokens = list(range(3, 3 + 256))  # 2 chunks of 128
        for cache in worker.kv_caches:
            cache.copy_(torch.randn_like(cache))
        engine.store(tokens, worker.kv_caches, slots_from_block_ids(list(range(4)), 64, len(tokens)))
        engine.flush()
        assert engine.lookup(tokens) == 256
        assert worker.reset_cache() == 2
        assert engine.lookup(tokens) == 0
    finally:
        worker.shutdown()
