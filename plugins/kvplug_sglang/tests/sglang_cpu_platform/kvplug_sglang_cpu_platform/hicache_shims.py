"""HiCache on a CPU "device": the two pieces SGLang 0.5.23 only has for CUDA/HIP/XPU/NPU.

Both are needed only with ``--enable-hierarchical-cache`` and only for
``--hicache-io-backend direct --hicache-mem-layout layer_first`` (the one host
layout whose transfer is a plain indexed copy). Neither touches kvplug: they sit
between SGLang's device pool and SGLang's host pool, below ``KVPlugStorage``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def alloc_unpinned(
    dims: tuple[int, ...],
    dtype: torch.dtype,
    device: str,
    pin_memory: bool,
    allocator: Any,
    registration_granularity_bytes: int | None = None,
) -> torch.Tensor:
    """Host pool allocation without page-locking.

    SGLang limitation: ``pool_host.common.ALLOC_MEMORY_FUNCS`` maps every device
    type it does not list (``cpu`` included) to ``alloc_with_host_register``, which
    pins the pool with ``cudaHostRegister`` and fails without an NVIDIA driver.
    Pinning only speeds up DMA to a GPU; with the "device" pool in host memory there
    is nothing to pin for.
    """
    if allocator is not None:
        return allocator.allocate(dims, dtype=dtype, device=device)
    return torch.empty(dims, dtype=dtype, device=device)


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Plain-torch ``sgl_kernel.kvcacheio.transfer_kv_direct``: ``dst[dst_indices] = src[src_indices]`` per layer.

    SGLang limitation: ``pool_host.mha`` imports its host<->device transfer ops from
    ``sgl_kernel`` only on CUDA/HIP (and XPU), so elsewhere ``io_backend="direct"``
    ends in ``NameError: transfer_kv_direct``. ``page_size`` only lets the kernel
    copy whole pages at once; an indexed copy needs no such hint.
    """
    if len(src_layers) != len(dst_layers):
        raise ValueError(
            f"transfer_kv_direct: {len(src_layers)} source layers but {len(dst_layers)} destination layers"
        )
    src_rows = src_indices.to(torch.int64)
    dst_rows = dst_indices.to(torch.int64)
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_rows.to(dst.device)] = src[src_rows.to(src.device)].to(dst.device)


def install() -> None:
    """Put both shims where SGLang's MHA host pool looks them up (idempotent)."""
    from sglang.srt.mem_cache.pool_host import common, mha

    common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_unpinned
    if not hasattr(mha, "transfer_kv_direct"):
        mha.transfer_kv_direct = transfer_kv_direct
