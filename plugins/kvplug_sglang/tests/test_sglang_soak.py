"""Nothing kvplug keeps per request outlives the request, in SGLang's tree cache run on and on.

The radix-cache backend, built by SGLang's own registry on a real (CPU) KV pool, serves rounds
of tiny requests the way the scheduler drives it (``sglang_soak.drive``): shared and fresh
prefixes, whole-prompt repeats, hits from the device tree and from kvplug, aborts in the
waiting queue, after a load-back and mid-run (a client gone mid-stream), ``/flush_cache``
(``reset``), a device pool small enough that SGLang evicts into kvplug, a cpu and a disk tier
that both evict, and disk records corrupted for real so some loads fail. After every round the
per-request state (load plans, tree locks, KV slots) is empty, long-lived state (the identities
of keys) is bounded, and threads and file descriptors are at their level after a warm-up round.

The HiCache backend (``KVPlugStorage``) gets the same: rounds of page writes, lookups and
loads into a real host pool with corrupt records among them, ``clear`` (SGLang's flush of its
storage), and a detach and attach of the backend (SGLang's ``/hicache/storage-backend``): no
read in flight or given up, no host slot held, no thread or descriptor left by a closed backend.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_flow import build_stack, published_server_args
from sglang_soak import ABORTS, RETRACTED, drive, flush_cache, process_level
from test_sglang_hicache import make_backend, make_host, page_keys, random_pages

from kvplug_sglang.bounded_reads import MAX_READS_IN_FLIGHT

pytestmark = pytest.mark.usefixtures("registered")

ROUNDS = 8
#: Rounds before threads and fds are at their level (the disk tier's writers start as work comes).
WARM_UP = 2
#: Thread pools that start their threads as work comes, up to a bound: name -> bound.
POOLS = {"kvplug-disk-io": 2}
POOL = 192  # device KV slots: a few prompts' worth, so SGLang evicts into kvplug


def corrupt(folder: Path) -> int:
    """Overwrite the middle of every record in ``folder``: loads of them fail their checksum."""
    records = [path for path in folder.rglob("*.kvr") if path.is_file()]
    for path in records:
        data = bytearray(path.read_bytes())
        middle = len(data) // 2
        data[middle : middle + 64] = bytes(64)
        path.write_bytes(bytes(data))
    return len(records)


def assert_level(rounds: list[dict[str, Any]]) -> None:
    """Threads and fds at the warm-up round's level; a pool's threads, which start as work
    comes, within its bound."""
    warm = steady(rounds[WARM_UP - 1]["level"])
    for number, round_ in enumerate(rounds[WARM_UP:], start=WARM_UP):
        level = steady(round_["level"])
        assert level == warm, f"round {number}: threads or fds grew from {warm}: {level}"
        pooled = round_["level"]["python_threads"]
        assert all(pooled.get(name, 0) <= bound for name, bound in POOLS.items()), pooled


def steady(level: dict[str, Any]) -> tuple[dict[str, int], int, int]:
    """A round's threads by name and other threads (OpenMP's...) but the pools', and fds."""
    threads = {name: count for name, count in level["python_threads"].items() if name not in POOLS}
    pooled = sum(level["python_threads"].get(name, 0) for name in POOLS)
    return threads, level["tasks"] - pooled, level["fds"]


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_backend_keeps_nothing_per_request(
    model_config: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, page_size: int
) -> None:
    disk = tmp_path / "disk"
    tiers = [
        {"type": "cpu", "max_bytes": "64KiB"},
        {"type": "disk", "path": str(disk), "max_bytes": "256KiB", "write_threads": POOLS["kvplug-disk-io"]},
    ]
    monkeypatch.setenv("KVPLUG_CHUNK_SIZE", "16")
    monkeypatch.setenv("KVPLUG_STORE__QUEUE__MODE", "sync")
    monkeypatch.setenv("KVPLUG_TIERS", json.dumps(tiers))
    rng = random.Random(29)
    prefixes = [[rng.randrange(100, 1000) for _ in range(40)] for _ in range(3)]
    served: list[list[int]] = []
    counts = dict.fromkeys(("requests", "aborted", "retracted", "promised", "loaded"), 0)
    rounds: list[dict[str, Any]] = []
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, model_config, page_size=page_size, size=POOL)
        tree, allocator = stack.tree, stack.allocator
        try:
            for number in range(ROUNDS):
                for i in range(16):
                    kind = i % 4
                    if kind == 0:
                        tokens = rng.choice(prefixes) + [rng.randrange(100, 1000) for _ in range(rng.randrange(1, 30))]
                    elif kind == 1:
                        tokens = [rng.randrange(100, 1000) for _ in range(rng.randrange(8, 60))]
                    else:  # a whole prompt again: from the tree, or from kvplug once the tree evicted it
                        tokens = rng.choice(served) if served else rng.choice(prefixes)
                    abort = ABORTS[i % 5] if i % 5 < len(ABORTS) else None
                    rid = f"r{number}-{i}"
                    if i % 8 == 7:  # preempted after its prefill, then run again from the queue
                        drive(stack, rid, tokens, seed=number * 100 + i, abort=RETRACTED)
                        counts["retracted"] += 1
                    promised, loaded = drive(stack, rid, tokens, seed=number * 100 + i, abort=abort)
                    counts["requests"] += 1
                    counts["aborted"] += abort is not None
                    counts["promised"] += promised
                    counts["loaded"] += loaded
                    served.append(tokens)
                    if i % 6 == 5:  # the tree makes room: evicted nodes are stored into kvplug
                        tree.evict(EvictParams(num_tokens=POOL // 2))
                if number % 2:
                    tree.engine.flush()
                    corrupt(disk)
                    flush_cache(stack)
                tree.engine.flush()
                rounds.append(
                    {
                        "sizes": {
                            "tree._plans": len(tree._plans),
                            "tree.protected_size": tree.protected_size(),
                            "slots neither free nor in the tree": POOL
                            - allocator.available_size()
                            - tree.evictable_size(),
                            "discards._removing": len(tree.engine.chain._discards._removing),
                        },
                        "keys of adapters": len(tree.request_keys._adapters),
                        "level": process_level(),
                    }
                )
            evictions = [stats.evictions for _, stats in tree.engine.chain.stats()]
        finally:
            tree.shutdown()
    # the run went down the paths it is meant to: else a structure may be empty for want of use
    assert counts["aborted"] >= 3 * ROUNDS and counts["retracted"] >= ROUNDS and counts["loaded"] > 0, counts
    assert tree.load_failures > 0, "no load failed: the corrupted records were not read"
    assert all(evictions), f"a tier never evicted: {evictions}"
    for number, round_ in enumerate(rounds):
        kept = {name: size for name, size in round_["sizes"].items() if size}
        assert not kept, f"round {number}: state left after every request ended: {kept}"
        assert round_["keys of adapters"] <= tree.request_keys._limit
    assert_level(rounds)


def test_hicache_backend_keeps_nothing_per_page(tmp_path: Path) -> None:
    disk = tmp_path / "l3"
    tiers = [
        {"type": "cpu", "max_bytes": "48KiB"},
        {"type": "disk", "path": str(disk), "max_bytes": "160KiB", "write_threads": POOLS["kvplug-disk-io"]},
    ]
    kvplug = {"tiers": tiers, "store": {"queue": {"mode": "sync"}}}
    host = make_host("layer_first")
    free_at_start = host.available_size()
    rng = random.Random(29)
    prefixes = [[rng.randrange(100, 1000) for _ in range(12)] for _ in range(3)]
    counts = dict.fromkeys(("stored", "loaded", "missed"), 0)
    evictions = [0, 0]  # of each tier, over every backend attached
    rounds: list[dict[str, Any]] = []
    backend = make_backend(host, kvplug)
    try:
        for number in range(ROUNDS):
            for i in range(12):
                tokens = rng.choice(prefixes) + [rng.randrange(100, 1000) for _ in range(4 * rng.randrange(1, 4))]
                keys = page_keys(tokens)
                hit = backend.batch_exists(keys)
                if hit < len(keys):  # what SGLang backs up: the pages storage does not hold
                    src = random_pages(host, len(keys) - hit, seed=number * 100 + i)
                    assert backend.batch_set_v1(keys[hit:], src) == [True] * (len(keys) - hit)
                    counts["stored"] += len(keys) - hit
                    host.free(src)
                hit = backend.batch_exists(keys)
                if hit:  # a prefetch of the pages storage holds
                    dst = host.alloc(hit * 4)
                    got = backend.batch_get_v1(keys[:hit], dst)
                    counts["loaded"] += sum(got)
                    counts["missed"] += got.count(False)
                    host.free(dst)
            backend.flush()
            corrupt(disk)
            if number % 2:
                backend.clear()  # SGLang's flush of its storage
            if number % 3 == 2:  # detach and attach again (SGLang's /hicache/storage-backend)
                for index, (_, stats) in enumerate(backend.store.chain.stats()):
                    evictions[index] += stats.evictions
                backend.close()
                backend = make_backend(host, kvplug)
            assert backend.store is not None
            rounds.append(
                {
                    "sizes": {
                        "reads in flight": MAX_READS_IN_FLIGHT - backend.reads._room._value,
                        "reads given up": backend.reads.given_up,
                        "host slots held": free_at_start - host.available_size(),
                        "discards._removing": len(backend.store.chain._discards._removing),
                    },
                    "level": process_level(),
                }
            )
        assert backend.store is not None
        for index, (_, stats) in enumerate(backend.store.chain.stats()):
            evictions[index] += stats.evictions
    finally:
        backend.close()
    assert counts["stored"] and counts["loaded"] and counts["missed"], counts
    assert all(evictions), f"a tier never evicted: {evictions}"
    for number, round_ in enumerate(rounds):
        kept = {name: size for name, size in round_["sizes"].items() if size}
        assert not kept, f"round {number}: state left after every read ended: {kept}"
    assert_level(rounds)
