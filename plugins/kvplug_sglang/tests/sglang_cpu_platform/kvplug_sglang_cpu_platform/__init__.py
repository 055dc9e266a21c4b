"""Test support only: run ``python -m sglang.launch_server --device cpu`` without ``sgl_kernel``.

SGLang 0.5.23 cannot serve a model on a plain CPU machine by itself: ``--device cpu``
with no platform selected falls back to vLLM's rotary-embedding op (``No module
named 'vllm'``), and its own CPU engine (``SGLANG_USE_CPU_ENGINE=1``) needs
``sgl_kernel``, which has no CPU wheel. SGLang's platform-plugin mechanism (entry
point group ``sglang.srt.platforms``) is the supported way to describe another
device, so this package describes "a CPU with plain torch and nothing else":
fused ops take SGLang's own ``forward_native`` implementations, Triton and graph
capture are off, attention defaults to ``torch_native``. Two HiCache gaps are
shimmed in :mod:`kvplug_sglang_cpu_platform.hicache_shims`, each naming the SGLang
limitation it covers.

It is opt-in: the platform is used only in processes started with
``SGLANG_PLATFORM=kvplug_test_cpu`` (kvplug-sglang's server-test fixtures and
``benchmarks/bench_sglang.py --server``), never on a machine with CUDA, and never
by the in-process tests that build SGLang's classes directly. It is not part of
kvplug-sglang, and SGLang's speed on it says nothing about SGLang on a GPU.
"""

from __future__ import annotations

import os

PLATFORM_NAME = "kvplug_test_cpu"
PLATFORM_CLASS = "kvplug_sglang_cpu_platform.platform:KVPlugTestCpuPlatform"


def activate() -> str | None:
    """Entry point: the platform class's qualified name, or None to stay out of the way.

    SGLang calls every platform plugin's function when it resolves its platform
    and refuses to start when more than one answers, so this one answers only
    when asked for by name and when there is no CUDA device to use instead.
    """
    if os.environ.get("SGLANG_PLATFORM") != PLATFORM_NAME:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return PLATFORM_CLASS
