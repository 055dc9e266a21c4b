"""A worker whose caches are laid out in other blocks than vLLM's block tables hand out.

vLLM splits each of its blocks into several of the attention kernel's when the backend does
not take the block size as is (``kernel_block_size``: e.g. FlashInfer with ``--block-size
128`` lays the cache out in blocks of 64). kvplug addresses the cache by the scheduler's
block ids, so such a worker would copy other slots' KV: it is refused when vLLM registers
its caches, with a message naming both sizes and what to change.

No engine: ``WorkerSide.register_kv_caches`` with vLLM's config, KV cache groups and rank
lookups as plain data (the caches real tensors in the flash layout vLLM's GPU backends use).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.distributed import parallel_state

from kvplug.errors import LayoutError
from kvplug.testing.control_cli import socket_dir
from kvplug_vllm.kv_groups import kv_groups
from kvplug_vllm.settings import ConnectorSettings
from kvplug_vllm.worker import WorkerSide

__all__ = ["socket_dir"]  # a fixture

NAMES = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch, socket_dir: Path) -> Iterator[None]:
    """One rank, its control socket in a folder of its own (``socket_dir``: the variable it
    sets is removed afterwards, so the engines later tests start do not inherit it)."""
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=0))
    monkeypatch.setattr(parallel_state, "get_tp_group", lambda: SimpleNamespace(world_size=1, cpu_group=None))
    yield


def vllm_config(block_size: int) -> Any:
    model = SimpleNamespace(
        model="org/tiny",
        revision=None,
        use_mla=False,
        served_model_name="tiny",
        get_num_kv_heads=lambda _: 2,
        get_total_num_kv_heads=lambda: 2,
        get_head_size=lambda: 64,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_rank=0),
        cache_config=SimpleNamespace(block_size=block_size, cache_dtype="auto"),
        kv_transfer_config=SimpleNamespace(is_kv_consumer=True, is_kv_producer=True),
        kv_events_config=None,
    )


def register(manager_block_size: int, kernel_block_size: int, *, kv_events: bool = False) -> WorkerSide:
    spec = SimpleNamespace(block_size=manager_block_size, num_kv_heads=2, sliding_window=None)
    groups = kv_groups(SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec, layer_names=NAMES)]))
    extra = {"kvplug.chunk_size": 128, "kvplug.tiers": [{"type": "cpu", "max_bytes": "16MiB"}]}
    config = vllm_config(manager_block_size)
    if kv_events:
        config.kv_events_config = SimpleNamespace(enable_kv_cache_events=True)
    worker = WorkerSide(None, config, ConnectorSettings(), extra, ("kernel-blocks", 0, 0), kv_groups=groups)
    blocks = 8 * manager_block_size // kernel_block_size
    caches = {name: torch.zeros(2, blocks, kernel_block_size, 2, 64, dtype=torch.bfloat16) for name in NAMES}
    worker.register_kv_caches(caches)
    return worker


@pytest.mark.usefixtures("one_rank")
def test_caches_in_vllms_own_blocks_are_served() -> None:
    worker = register(64, 64)
    try:
        assert worker.engine is not None and worker.engine.layout.block_size == 64
    finally:
        worker.shutdown()


@pytest.mark.usefixtures("one_rank")
def test_caches_in_smaller_kernel_blocks_are_refused_naming_both_sizes() -> None:
    with pytest.raises(LayoutError, match=r"blocks of 128 tokens.*blocks of 64.*--block-size 64"):
        worker = register(128, 64)
        worker.shutdown()


@pytest.mark.usefixtures("one_rank")
@pytest.mark.parametrize("pp_rank", [0, 1])
def test_only_the_first_rank_publishes_kv_events(pp_rank: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM publishes an event only when every worker reporting events in a step reported it:
    the ranks' tier writes land in different steps, so only the first rank (tensor- and
    pipeline-parallel rank 0) publishes. (A pipeline rank here: a tensor-parallel one would
    need caches of its heads.)"""
    monkeypatch.setattr(parallel_state, "get_pp_group", lambda: SimpleNamespace(rank_in_group=pp_rank))
    worker = register(64, 64, kv_events=True)
    try:
        assert (worker.index is not None) == (pp_rank == 0)
    finally:
        worker.shutdown()
