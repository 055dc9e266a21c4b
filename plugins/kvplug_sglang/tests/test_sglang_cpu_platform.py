"""The test-only CPU platform (tests/sglang_cpu_platform): opt-in, and what SGLang makes of it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

kvplug_sglang_cpu_platform = pytest.importorskip(
    "kvplug_sglang_cpu_platform", reason="pip install --no-deps -e plugins/kvplug_sglang/tests/sglang_cpu_platform"
)
from kvplug_sglang_cpu_platform.hicache_shims import transfer_kv_direct  # noqa: E402


def test_activates_only_when_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SGLANG_PLATFORM", raising=False)
    assert kvplug_sglang_cpu_platform.activate() is None
    monkeypatch.setenv("SGLANG_PLATFORM", "kvplug_test_cpu")
    expected = None if torch.cuda.is_available() else kvplug_sglang_cpu_platform.PLATFORM_CLASS
    assert kvplug_sglang_cpu_platform.activate() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine the platform stays out of the way")
def test_sglang_resolves_the_platform_in_a_fresh_process() -> None:
    code = (
        "import warnings; warnings.filterwarnings('ignore');"
        "from sglang.srt.platforms import current_platform as p;"
        "print(type(p).__name__, p.is_out_of_tree(), p.get_default_attention_backend(), p.capabilities.supports_triton)"
    )
    env = {**os.environ, "SGLANG_PLATFORM": "kvplug_test_cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split()[-4:] == ["KVPlugTestCpuPlatform", "True", "torch_native", "False"]


def test_transfer_kv_direct_copies_the_indexed_rows() -> None:
    src = [torch.randn(16, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    dst = [torch.zeros(32, 2, 4, dtype=torch.bfloat16) for _ in range(3)]
    src_rows, dst_rows = torch.tensor([3, 0, 7, 8]), torch.tensor([30, 1, 2, 16])
    transfer_kv_direct(src, dst, src_rows, dst_rows, page_size=1)
    for s, d in zip(src, dst):
        assert torch.equal(d[dst_rows], s[src_rows])
        untouched = torch.ones(32, dtype=torch.bool)
        untouched[dst_rows] = False
        assert not d[untouched].any()
    with pytest.raises(ValueError, match="2 source layers but 3 destination layers"):
        transfer_kv_direct(src[:2], dst, src_rows, dst_rows, page_size=1)
