"""The SGLang platform: a CPU served with plain torch (test support, see the package docstring)."""

from __future__ import annotations

from typing import Any

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform


class KVPlugTestCpuPlatform(CpuDeviceMixin, SRTPlatform):
    """CPU device operations from SGLang's own CPU mixin, registered as an out-of-tree platform.

    Being out of tree (``PlatformEnum.OOT``) is what makes SGLang pick its plain-torch
    paths: ``RotaryEmbedding`` skips the vLLM/sgl_kernel fallback kernel, and fused ops
    dispatch on :meth:`get_dispatch_key_name` to ``forward_native``. The in-tree CPU
    platform instead expects ``sgl_kernel``'s CPU build.
    """

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # No Triton, no CUDA/graph capture, no sgl_kernel HiCache transfer kernels.
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_dispatch_key_name(self) -> str:
        return "native"

    def is_pin_memory_available(self, device: Any = None) -> bool:
        return False

    def init_backend(self) -> None:
        # Runs in every scheduler/worker process (model_runner import), before
        # HiCache builds its host pools.
        from kvplug_sglang_cpu_platform.hicache_shims import install

        install()
