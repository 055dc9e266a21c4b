"""Shared fixtures: without CUDA the kernels run in Triton's CPU interpreter.

``TRITON_INTERPRET`` is read when Triton compiles a kernel module, so it is set here,
before any test imports :mod:`kvplug_cuda.kernels`. With CUDA the same tests run the
compiled kernels on the GPU, through the copy stream and the pinned pool.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from kvplug import KVLayout, PagedFormat
from kvplug.core.plugins import PluginRegistry

# The engine formats as their adapters declare them (kvplug_vllm, kvplug_sglang): this
# plugin imports no other plugin, so its tests keep copies (same names and axes).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
VLLM_MLA = PagedFormat("vllm_mla", ("block", "token", "dim"), latent=True)
VLLM_CPU = PagedFormat("vllm_cpu", ("block", "head", "kv", "token", "dim"), whole_blocks_only=True)
SGLANG_MHA = PagedFormat("sglang_mha", ("slot", "head", "dim"), tensors=2)
FORMATS = {f.name: f for f in (VLLM_FLASH, VLLM_MLA, VLLM_CPU, SGLANG_MHA)}

#: Where the caches of the kernel tests live: the GPU when there is one.
DEVICE = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

#: Every dtype kvplug stores, fp8 included.
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device; torch.cuda.is_available() is False"
)


def random_bits(shape: tuple[int, ...], dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """Random bytes viewed as ``dtype``: NaN payloads and all, so only a bit-exact copy matches."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), generator=generator, dtype=torch.uint8)
    return raw.view(dtype)


def make_caches(
    layout: KVLayout, num_blocks: int, generator: torch.Generator, *, device: torch.device = DEVICE
) -> list:
    """Per-layer caches of ``layout`` full of random bits, on ``device``."""
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    caches: list = []
    for _ in range(layout.num_layers):
        if layout.format == VLLM_FLASH:
            caches.append(random_bits((2, num_blocks, b, h, d), layout.dtype, generator).to(device))
        elif layout.format == VLLM_MLA:
            caches.append(random_bits((num_blocks, b, d), layout.dtype, generator).to(device))
        else:
            caches.append(
                tuple(random_bits((num_blocks * b, h, d), layout.dtype, generator).to(device) for _ in range(2))
            )
    return caches


def flat(caches: list) -> list[torch.Tensor]:
    return [t for cache in caches for t in (cache if isinstance(cache, tuple) else (cache,))]


def clone(caches: list) -> list:
    return [tuple(t.clone() for t in c) if isinstance(c, tuple) else c.clone() for c in caches]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def caches_same_bits(a: list, b: list) -> bool:
    return all(same_bits(x.cpu(), y.cpu()) for x, y in zip(flat(a), flat(b), strict=True))


@pytest.fixture(scope="session")
def registry() -> PluginRegistry:
    """Builtins (the torch reference), this plugin and the cpu tier."""
    return PluginRegistry(plugin_filter="cuda,cpu")


@pytest.fixture(scope="session")
def connectors(registry: PluginRegistry) -> dict[str, type]:
    return registry.kv_connectors()
