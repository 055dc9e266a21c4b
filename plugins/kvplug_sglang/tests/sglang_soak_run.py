"""The soaks of ``test_sglang_soak.py``, each run in a process of its own (other tests' threads
and descriptors, still ending in a shared pytest worker, would move the levels it measures).

``python sglang_soak_run.py <radix|hicache> <folder>`` prints one JSON line: per round the
sizes of the per-request state and the process's level, and counts of what happened.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path
from typing import Any

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang_flow import build_stack, published_server_args
from sglang_pools import write_model_dir
from sglang_soak import ABORTS, POOLS, RETRACTED, drive, flush_cache, process_level
from test_sglang_hicache import make_backend, make_host, page_keys, random_pages

from kvplug_sglang.bounded_reads import MAX_READS_IN_FLIGHT
from kvplug_sglang.plugin import register

ROUNDS = 8
#: Keys no tier holds a control journal keeps at most in a soak (its default is 16384, past any soak).
JOURNAL_WAITING = 8
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


def journal_level(journal: Any, chain: Any) -> dict[str, int]:
    """The keys a control journal remembers, and the records its tiers hold (over all tiers)."""
    return {"journal": len(journal._keys), "tiers_hold": sum(stats.items for _, stats in chain.stats())}


def soak_radix(folder: Path, page_size: int) -> dict[str, Any]:
    disk = folder / "disk"
    tiers = [
        {"type": "cpu", "max_bytes": "64KiB"},
        {"type": "disk", "path": str(disk), "max_bytes": "256KiB", "write_threads": POOLS["kvplug-disk-io"]},
    ]
    os.environ.update(KVPLUG_CHUNK_SIZE="16", KVPLUG_STORE__QUEUE__MODE="sync", KVPLUG_TIERS=json.dumps(tiers))
    rng = random.Random(29)
    prefixes = [[rng.randrange(100, 1000) for _ in range(40)] for _ in range(3)]
    served: list[list[int]] = []
    counts = dict.fromkeys(("requests", "aborted", "retracted", "promised", "loaded"), 0)
    rounds: list[dict[str, Any]] = []
    with published_server_args(radix_cache_backend="kvplug") as args:
        stack = build_stack(args, ModelConfig(str(write_model_dir(folder / "model"))), page_size=page_size, size=POOL)
        tree, allocator = stack.tree, stack.allocator
        assert tree.control is not None
        journal = tree.control.target.journal
        journal.max_waiting = JOURNAL_WAITING
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
                sizes = {
                    "tree._plans": len(tree._plans),
                    "tree.protected_size": tree.protected_size(),
                    "slots neither free nor in the tree": POOL - allocator.available_size() - tree.evictable_size(),
                    "discards._removing": len(tree.engine.chain._discards._removing),
                }
                keys = len(tree.request_keys._adapters)
                level = journal_level(journal, tree.engine.chain)
                rounds.append({"sizes": sizes, "keys_of_adapters": keys, "level": process_level(), **level})
            evictions = [stats.evictions for _, stats in tree.engine.chain.stats()]
        finally:
            tree.shutdown()
    return {
        "rounds": rounds,
        "counts": counts,
        "load_failures": tree.load_failures,
        "evictions": evictions,
        "keys_limit": tree.request_keys._limit,
    }


def soak_hicache(folder: Path) -> dict[str, Any]:
    disk = folder / "l3"
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
    assert backend.target is not None
    backend.target.journal.max_waiting = JOURNAL_WAITING

    def count_evictions() -> None:
        assert backend.store is not None
        for index, (_, stats) in enumerate(backend.store.chain.stats()):
            evictions[index] += stats.evictions

    try:
        for number in range(ROUNDS):
            for i in range(12):
                tokens = rng.choice(prefixes) + [rng.randrange(100, 1000) for _ in range(4 * rng.randrange(1, 4))]
                keys = page_keys(tokens)
                hit = backend.batch_exists(keys)
                if hit < len(keys):  # what SGLang backs up: the pages storage does not hold
                    src = random_pages(host, len(keys) - hit, seed=number * 100 + i)
                    backend.batch_set_v1(keys[hit:], src)
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
                count_evictions()
                backend.close()
                backend = make_backend(host, kvplug)
                assert backend.target is not None
                backend.target.journal.max_waiting = JOURNAL_WAITING
            assert backend.store is not None and backend.target is not None
            sizes = {
                "reads in flight": MAX_READS_IN_FLIGHT - backend.reads._room._value,
                "reads given up": backend.reads.given_up,
                "host slots held": free_at_start - host.available_size(),
                "discards._removing": len(backend.store.chain._discards._removing),
            }
            level = journal_level(backend.target.journal, backend.store.chain)
            rounds.append({"sizes": sizes, "level": process_level(), **level})
        count_evictions()
    finally:
        backend.close()
    return {"rounds": rounds, "counts": counts, "evictions": evictions}


def main(which: str, folder: str) -> None:
    """``radix``: a soak with page size 1 (SGLang's default), then one with 4 (in folders of their own)."""
    register()  # what SGLang does with its plugins in every process
    if which == "radix":
        result = {f"page_size={size}": soak_radix(Path(folder) / str(size), size) for size in (1, 4)}
    else:
        result = soak_hicache(Path(folder))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
