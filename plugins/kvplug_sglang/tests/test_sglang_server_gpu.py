"""End to end on a GPU: ``python -m sglang.launch_server`` with kvplug turned on both ways.

Each test starts a real server on a small model, sends a prompt (cold), flushes
SGLang's device cache (``/flush_cache``) so only kvplug can serve the prefix,
sends it again (warm), and checks that the greedy outputs are identical and that
the warm request was served from kvplug. TTFTs are printed, not asserted.

The model is ``KVPLUG_TEST_SGLANG_MODEL`` (a local path or hub id) or, without
it, a random-weight Llama written by the test (token ids in, token ids out).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

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


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    if os.environ.get("KVPLUG_TEST_SGLANG_MODEL"):
        return os.environ["KVPLUG_TEST_SGLANG_MODEL"]
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("random-llama")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=32000,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
        torch_dtype="bfloat16",
    )
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return str(path)


class Server:
    def __init__(self, model: str, extra_args: list[str], env: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            model,
            "--port",
            str(self.port),
            "--host",
            "127.0.0.1",
            "--skip-tokenizer-init",
            "--mem-fraction-static",
            "0.3",
            *extra_args,
        ]
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            args, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return
            except OSError:
                time.sleep(2)
        raise TimeoutError(f"server not healthy after 600 s; see {log}")

    def generate(self, input_ids: list[int]) -> tuple[list[int], float, dict]:
        body = json.dumps(
            {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}
        ).encode()
        started = time.perf_counter()
        request = urllib.request.Request(
            self.url + "/generate", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            result = json.loads(response.read())
        return result["output_ids"], time.perf_counter() - started, result.get("meta_info", {})

    def flush_device_cache(self) -> None:
        urllib.request.urlopen(urllib.request.Request(self.url + "/flush_cache", method="POST"), timeout=60)

    def stop(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        self.log.close()


@pytest.fixture
def serve(model_path: str, tmp_path: Path) -> Iterator:
    servers: list[Server] = []

    def start(extra_args: list[str], env: dict[str, str]) -> Server:
        servers.append(Server(model_path, extra_args, env, tmp_path / f"server{len(servers)}.log"))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


def _cold_then_warm(server: Server) -> None:
    cold_out, cold_s, _ = server.generate(PROMPT)
    time.sleep(2)  # let the store of the finished request reach the tiers
    server.flush_device_cache()
    warm_out, warm_s, meta = server.generate(PROMPT)
    print(f"TTFT-ish (16 tokens): cold {cold_s * 1e3:.0f} ms, warm {warm_s * 1e3:.0f} ms, meta {meta}")
    assert warm_out == cold_out, "outputs must be identical with and without the cache"
    assert meta.get("cached_tokens", 0) >= 1024, f"the warm request was not served from kvplug: {meta}"


def test_radix_cache_backend(serve, tmp_path: Path) -> None:
    env = {"KVPLUG_CHUNK_SIZE": "256", "KVPLUG_TIERS": json.dumps([{"type": "cpu", "max_bytes": "2GiB"}])}
    _cold_then_warm(serve(["--radix-cache-backend", "kvplug"], env))


def test_hicache_storage_backend(serve, tmp_path: Path) -> None:
    pytest.importorskip("kvplug_disk", reason="kvplug-disk is not installed")
    extra = {
        "backend_name": "kvplug",
        "module_path": "kvplug_sglang.hicache",
        "class_name": "KVPlugStorage",
        "interface_v1": 1,
        "kvplug": {"tiers": [{"type": "disk", "path": str(tmp_path / "l3")}]},
    }
    args = [
        "--enable-hierarchical-cache",
        "--hicache-storage-backend",
        "dynamic",
        "--hicache-storage-backend-extra-config",
        json.dumps(extra),
        "--page-size",
        "64",
    ]
    _cold_then_warm(serve(args, {}))
