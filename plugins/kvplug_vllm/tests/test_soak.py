"""Nothing kvplug keeps per request outlives the request, on a real vLLM engine that runs on.

One engine (tiny random Llama, a KV cache small enough that vLLM preempts, vLLM's prefix
cache and KV events on, a small cpu tier and a small disk tier that both evict, ``load:
auto`` so disk hits load in the background) serves rounds of tiny requests of mixed shapes
(soak_probe.py: shared and fresh prefixes, hits and misses, aborts at every stage, per-request
settings, disk records corrupted for real so some loads fail). After every round each
per-request structure of the connector's scheduler side (request states, background lookups,
pending KV events, stats samples) and worker side (background loads, failed-load books,
layer-wise step, stats samples, KV events), and vLLM's own request books, are empty; threads
and file descriptors stay at their level after the first (warm-up) rounds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import kv_config

from kvplug_vllm.background import FETCH_THREADS

ROUNDS = 16
#: Rounds before threads and fds are at their level.
WARM_UP = 2
#: Thread pools that start their threads as work comes, up to a bound: name -> bound.
POOLS = {"kvplug-load": FETCH_THREADS}


def test_a_long_run_keeps_nothing_per_request(run_engine: Any, tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    tiers = [{"type": "cpu", "max_bytes": "1MiB"}, {"type": "disk", "path": str(disk), "max_bytes": "3MiB"}]
    kv = kv_config(**{"kvplug.tiers": tiers, "kvplug.load": "auto", "kvplug.store.queue.mode": "sync"})
    result = run_engine(
        kv=kv,
        steps=[{"soak": {"rounds": ROUNDS, "disk": str(disk), "seed": 3}}],
        prefix_caching=True,
        num_blocks=24,
        max_model_len=512,
        kv_events={"enable_kv_cache_events": True, "publisher": "null"},
    )
    soak = result["steps"][0]["soak"]
    counts = soak["counts"]
    log = result["log"]
    # the run went down the paths it is meant to: else a structure may be empty for want of use
    assert counts["requests"] >= (ROUNDS - 1) * 16 and counts["aborted"] >= 3 * ROUNDS, counts
    assert counts["preempted_seen"] > 0 and counts["hit_tokens"] > 0, counts
    assert "in the background" in log and "did not load" in log
    for number, done in enumerate(soak["rounds"]):
        kept = {name: size for name, size in done["sizes"].items() if size}
        assert not kept, f"round {number}: state left after every request ended: {kept}"
    warm = steady(soak["rounds"][WARM_UP - 1]["level"])
    for number, done in enumerate(soak["rounds"][WARM_UP:], start=WARM_UP):
        level = steady(done["level"])
        assert level == warm, f"round {number}: threads or fds grew from {warm}: {level}"
        pooled = done["level"]["python_threads"]
        assert all(pooled.get(name, 0) <= bound for name, bound in POOLS.items()), pooled


def steady(level: dict[str, Any]) -> tuple[dict[str, int], int, int]:
    """A round's threads by name and other threads (OpenMP's...) but the pools', and fds."""
    threads = {name: count for name, count in level["python_threads"].items() if name not in POOLS}
    pooled = sum(level["python_threads"].get(name, 0) for name in POOLS)
    return threads, level["tasks"] - pooled, level["fds"]
