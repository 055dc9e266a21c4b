"""The kernel compiles to a cubin for real GPU architectures, on a machine without a GPU.

Triton's interpreter (what the kernel tests run in without CUDA) executes the
kernel's Python with numpy and forgives what the real compiler rejects: integer
width mismatches, a constexpr used as a runtime value, pointer arithmetic that
does not type-check. Here the exact launches the connector makes (same runtime
argument types, same constexprs, same compiler options; :func:`kernels.kernel_launch`) for
each layout and word width go through Triton's full pipeline (TTIR, TTGIR, LLVM,
PTX, ``ptxas``) for Ampere, Hopper and Blackwell targets. Nothing runs; ptxas ships
in the triton wheel and no driver is needed.
"""

from __future__ import annotations

import re

import pytest
import torch
import triton
from conftest import SGLANG_MHA, VLLM_FLASH, VLLM_MLA, make_caches
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kvplug import KVLayout
from kvplug_cuda import kernels
from kvplug_cuda.addressing import base_tensor, paged_addressing

#: (compute capability, what it is): the GPUs kvplug-cuda is meant for.
TARGETS = {80: "A100", 90: "H100/H200", 100: "B200"}

#: Layouts in the word widths the connector picks for them (head_dim * itemsize sets it).
LAYOUTS = {
    "vllm_flash bf16 (int64 words)": KVLayout(VLLM_FLASH, 2, 16, 8, 128, torch.bfloat16),
    "vllm_flash fp8 odd head_dim (int8 words)": KVLayout(VLLM_FLASH, 2, 16, 2, 3, torch.float8_e4m3fn),
    "vllm_mla bf16 (int64 words)": KVLayout(VLLM_MLA, 2, 16, 1, 576, torch.bfloat16),
    "sglang_mha fp16 head_dim 2 (int32 words)": KVLayout(SGLANG_MHA, 2, 1, 4, 2, torch.float16),
    "sglang_mha fp32 head_dim 1 (int32 words)": KVLayout(SGLANG_MHA, 2, 1, 3, 1, torch.float32),
}

_POINTEE = {torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8"}


def _triton_type(value: object) -> str:
    """The type Triton's launcher gives a runtime argument of this value."""
    if isinstance(value, torch.Tensor):
        return "*" + _POINTEE[value.dtype]
    assert isinstance(value, int) and not isinstance(value, bool), value
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def _launch(layout: KVLayout, *, to_chunk: bool) -> kernels.KernelLaunch:
    caches = make_caches(layout, 4, torch.Generator().manual_seed(0), device=torch.device("cpu"))
    addressing = paged_addressing(layout, caches)
    slots = torch.arange(5, dtype=torch.long)
    chunk = torch.empty(addressing.table.numel() * slots.numel() * addressing.row_words, dtype=addressing.word)
    base = base_tensor(layout, caches, addressing.word)
    launch = kernels.kernel_launch(addressing, base, slots, chunk, to_chunk=to_chunk)
    assert launch is not None
    return launch


def _compile(launch: kernels.KernelLaunch, capability: int):
    # The module's kernel is an InterpretedFunction under TRITON_INTERPRET=1; compile its source.
    kernel = JITFunction(kernels._paged_copy_kernel.fn)
    runtime_names = kernel.arg_names[: len(launch.arguments)]
    signature = {name: _triton_type(value) for name, value in zip(runtime_names, launch.arguments, strict=True)}
    signature |= {name: "constexpr" for name in launch.constants}
    assert list(signature) == kernel.arg_names, "kernel_launch and the kernel disagree on arguments"
    source = ASTSource(fn=kernel, signature=signature, constexprs=launch.constants)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=launch.options)


@pytest.mark.parametrize("to_chunk", [True, False], ids=["gather", "scatter"])
@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("capability", list(TARGETS), ids=[f"sm_{c}" for c in TARGETS])
def test_the_connectors_launch_compiles_to_a_cubin(capability: int, name: str, to_chunk: bool) -> None:
    launch = _launch(LAYOUTS[name], to_chunk=to_chunk)
    compiled = _compile(launch, capability)
    assert compiled.asm["cubin"], f"no cubin for sm_{capability}"
    word = _POINTEE[launch.arguments[3].dtype][1:]  # the chunk buffer's word width in bits
    ptx = compiled.asm["ptx"]
    # The copy moves whole words, never a float conversion: what makes fp8 and NaN payloads bit exact.
    assert re.search(rf"ld\.global[.\w]*\.b{word}", ptx) and re.search(rf"st\.global[.\w]*\.b{word}", ptx), ptx[-2000:]
    assert not re.search(r"\bcvt\.[\w.]*f(16|32|64)", ptx), "the kernel converts floats"
