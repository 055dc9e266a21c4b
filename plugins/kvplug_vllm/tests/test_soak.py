"""Nothing kvplug keeps per request outlives the request, on a real vLLM engine that runs on.

One engine (tiny random Llama, a KV cache small enough that vLLM preempts, vLLM's prefix
cache and KV events on, a small cpu tier and a small disk tier that both evict, ``load:
auto`` so disk hits load in the background) serves rounds of tiny requests of mixed shapes
(soak_probe.py: shared and fresh prefixes, hits and misses, aborts at every stage, per-request
settings, disk records corrupted for real so some loads fail). After every round each
per-request structure of the connector's scheduler side (request states, background lookups,
pending KV events, stats samples) and worker side (background loads, failed-load books,
layer-wise step, stats samples, KV events, the KV-events chunk index beyond what the tiers
hold), and vLLM's own request books, are empty; threads and file descriptors stay at their
level after the first (warm-up) rounds. A second engine adds a valkey tier behind the others:
lookups the local tiers cannot answer alone run in the background lookup pool.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import kv_config

from kvplug_valkey.testing import ValkeyServer
from kvplug_vllm.background import FETCH_THREADS

ROUNDS = 16
#: Rounds before threads and fds are at their level.
WARM_UP = 2
#: Thread pools that start their threads as work comes, up to a bound: name -> bound.
POOLS = {"kvplug-load": FETCH_THREADS, "kvplug-lookup": 8, "kvplug-disk-io": 4}
#: The valkey client's connections at most (its pool opens them as calls need them).
MAX_CONNECTIONS = 8


def soak(
    run_engine: Any, disk: Path, tiers: list[dict[str, Any]], pooled_port: int | None = None, **settings: Any
) -> dict[str, Any]:
    """``pooled_port``: a server whose client opens connections as calls need them, up to
    :data:`MAX_CONNECTIONS`: counted apart from the fds that must stay at their level."""
    kv = kv_config(**{"kvplug.tiers": tiers, "kvplug.load": "auto", "kvplug.store.queue.mode": "sync", **settings})
    result = run_engine(
        kv=kv,
        steps=[{"soak": {"rounds": ROUNDS, "disk": str(disk), "seed": 3, "pooled_port": pooled_port}}],
        prefix_caching=True,
        num_blocks=24,
        max_model_len=512,
        kv_events={"enable_kv_cache_events": True, "publisher": "null"},
    )
    done: dict[str, Any] = result["steps"][0]["soak"]
    counts = done["counts"]
    # the run went down the paths it is meant to: else a structure may be empty for want of use
    assert counts["requests"] >= (ROUNDS - 1) * 16 and counts["aborted"] >= 3 * ROUNDS, counts
    assert counts["preempted_seen"] > 0 and counts["hit_tokens"] > 0, counts
    assert "in the background" in result["log"], "no background load"
    for number, round_ in enumerate(done["rounds"]):
        kept = {name: size for name, size in round_["sizes"].items() if size}
        assert not kept, f"round {number}: state left after every request ended: {kept}"
    warm = steady(done["rounds"][WARM_UP - 1]["level"])
    for number, round_ in enumerate(done["rounds"][WARM_UP:], start=WARM_UP):
        level = steady(round_["level"])
        assert level == warm, f"round {number}: threads or fds grew from {warm}: {level}"
        pooled = round_["level"]["python_threads"]
        assert all(pooled.get(name, 0) <= bound for name, bound in POOLS.items()), pooled
        assert round_["level"]["pooled_connections"] <= MAX_CONNECTIONS, round_["level"]
    done["log"] = result["log"]
    return done


def steady(level: dict[str, Any]) -> tuple[dict[str, int], int, int]:
    """A round's threads by name and other threads (OpenMP's...) but the pools', and fds."""
    threads = {name: count for name, count in level["python_threads"].items() if name not in POOLS}
    pooled = sum(level["python_threads"].get(name, 0) for name in POOLS)
    return threads, level["tasks"] - pooled, level["fds"]


def local_tiers(disk: Path) -> list[dict[str, Any]]:
    return [
        {"type": "cpu", "max_bytes": "1MiB"},
        {"type": "disk", "path": str(disk), "max_bytes": "3MiB", "write_threads": POOLS["kvplug-disk-io"]},
    ]


def test_a_long_run_keeps_nothing_per_request(run_engine: Any, tmp_path: Path) -> None:
    done = soak(run_engine, tmp_path / "disk", local_tiers(tmp_path / "disk"))
    assert "did not load" in done["log"], "no load failed: the corrupted records were not read"


def test_a_long_run_with_background_lookups_keeps_nothing_per_request(run_engine: Any, tmp_path: Path) -> None:
    with ValkeyServer(tmp_path / "valkey") as server:
        valkey = {
            "type": "valkey",
            "url": f"redis://127.0.0.1:{server.port}",
            "key_prefix": "soak:",
            "max_connections": MAX_CONNECTIONS,
            "max_concurrency": 2,
        }
        done = soak(
            run_engine,
            tmp_path / "disk",
            [*local_tiers(tmp_path / "disk"), valkey],
            server.port,
            **{"kvplug.background_lookups": True, "kvplug.max_background_lookups": POOLS["kvplug-lookup"]},
        )
    assert done["counts"]["pooled_seen"] > 0, done["counts"]
