"""End to end on a GPU: ``python -m sglang.launch_server`` with kvplug turned on both ways.

Each test starts a real server on a small model, sends a prompt (cold), flushes
SGLang's device cache (``/flush_cache``) so only kvplug can serve the prefix,
sends it again (warm), and checks that the greedy outputs are identical and that
the warm request was served from kvplug. TTFTs are printed, not asserted.

The model is ``KVPLUG_TEST_SGLANG_MODEL`` (a local path or hub id) or, without
it, a random-weight Llama written by the test (token ids in, token ids out).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kvplug_sglang.testing import SGLangServer, hicache_args, kvplug_env, write_random_llama

# On CPU, test_sglang_server.py runs the same flows (both backends, cold / flush / restart)
# on the test-only CPU platform; what only a GPU has is SGLang's CUDA path: sgl_kernel's
# HiCache transfer kernels (io backend "kernel", layout page_first) and pinned host pools.
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="needs CUDA: SGLang's CUDA kernels and pinned HiCache pools (CPU flows: test_sglang_server.py)",
    ),
]

PROMPT = list(range(10, 10 + 1500))

Start = Callable[[list[str], dict[str, str]], SGLangServer]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    if os.environ.get("KVPLUG_TEST_SGLANG_MODEL"):
        return os.environ["KVPLUG_TEST_SGLANG_MODEL"]
    return str(write_random_llama(tmp_path_factory.mktemp("random-llama"), large=True))


@pytest.fixture
def serve(model_path: str, tmp_path: Path) -> Iterator[Start]:
    """Start a server and wait until it is healthy; every one is stopped at the end of the test."""
    servers: list[SGLangServer] = []

    def start(extra_args: list[str], env: dict[str, str]) -> SGLangServer:
        server = SGLangServer(model_path, extra_args, env, tmp_path / f"server{len(servers)}.log")
        servers.append(server)
        return server.wait_healthy()

    yield start
    for server in servers:
        server.stop()


def _cold_then_warm(server: SGLangServer) -> None:
    cold_out, cold_s, _ = server.generate(PROMPT, max_new_tokens=16)
    time.sleep(2)  # let the store of the finished request reach the tiers
    server.flush_cache()
    warm_out, warm_s, meta = server.generate(PROMPT, max_new_tokens=16)
    print(f"TTFT-ish (16 tokens): cold {cold_s * 1e3:.0f} ms, warm {warm_s * 1e3:.0f} ms, meta {meta}")
    assert warm_out == cold_out, "outputs must be identical with and without the cache"
    assert meta.get("cached_tokens", 0) >= 1024, f"the warm request was not served from kvplug: {meta}"


def test_radix_cache_backend(serve: Start) -> None:
    env = kvplug_env([{"type": "cpu", "max_bytes": "2GiB"}])
    _cold_then_warm(serve(["--radix-cache-backend", "kvplug"], env))


def test_hicache_storage_backend(serve: Start, tmp_path: Path) -> None:
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    _cold_then_warm(serve(hicache_args([{"type": "disk", "path": str(tmp_path / "l3")}]), {}))
