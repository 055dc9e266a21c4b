"""kvplug's radix-cache backend in a real tensor-parallel SGLang server (``--tp-size 2``).

A ``python -m sglang.launch_server`` with two TP ranks, one scheduler process each (a core each:
``SGLANG_CPU_OMP_THREADS_BIND``). Each rank stores its own record of every chunk (its fingerprint
names its KV heads), and the ranks agree on every hit and load (all_reduce MIN over their CPU
group): a chunk one rank lacks or cannot load is recomputed by both, never loaded by one alone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import kvplug
from kvplug.testing import run_ctl
from kvplug.testing.control_cli import socket_dir  # noqa: F401  (fixture)
from kvplug_disk.files import digest_of
from kvplug_sglang.setup_engine import build_cache_engine
from kvplug_sglang.testing import SGLangServer, kvplug_env, write_random_llama

pytestmark = pytest.mark.timeout(900)

TP = 2
CHUNK = 64
WHOLE = 3 * CHUNK
#: One prompt per case; not [10, 11, 12] (SGLang's warm-up request).
STORED, ONE_RANK_CORRUPT, ONE_RANK_MISSING = ([1000 + 7 * p + i for i in range(WHOLE + 8)] for p in range(3))


@dataclass(frozen=True)
class Served:
    server: SGLangServer
    store: Path  # the disk tier's folder
    model: Path
    sockets: Path  # the control sockets' folder


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    folder = tmp_path_factory.mktemp("tp")
    model = write_random_llama(folder / "model")
    sockets = folder / "ctl"
    sockets.mkdir(mode=0o700)
    store = folder / "kv"
    env = {
        **kvplug_env([{"type": "disk", "path": str(store)}], chunk_size=CHUNK),
        "KVPLUG_LOOKUP_DIR": str(sockets),
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # a core per rank (SGLang otherwise asks a NUMA node each)
    }
    server = SGLangServer(str(model), ["--tp-size", str(TP), "--radix-cache-backend", "kvplug"], env, folder / "log")
    try:
        yield Served(server.wait_healthy(), store, model, sockets)
    finally:
        server.stop()


def lookup(sockets: Path, tmp_path: Path, prompt: list[int]) -> list[int]:
    """``kvplug ctl lookup``: each rank's hit, by TP rank."""
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(map(str, prompt)))
    ranks = run_ctl(sockets, "lookup", str(path))["ranks"]
    return [r["hit_tokens"] for r in sorted(ranks, key=lambda r: r["tp_rank"])]


def wait_stored(served: Served, tmp_path: Path, prompt: list[int]) -> None:
    """Each rank stores on its own background worker: wait until both hold the prompt."""
    deadline = time.monotonic() + 120
    while (hits := lookup(served.sockets, tmp_path, prompt)) != [WHOLE] * TP:
        assert time.monotonic() < deadline, hits
        time.sleep(0.5)


def rank_record(served: Served, prompt: list[int], tp_rank: int) -> Path:
    """The file of one rank's record of ``prompt``'s first chunk (its key as that rank makes it)."""
    from sglang.srt.configs.model_config import ModelConfig

    layers = [torch.zeros(8, 2 // TP, 32, dtype=torch.bfloat16) for _ in range(2)]  # its share of 2 KV heads of 32
    config = kvplug.KVPlugConfig(chunk_size=CHUNK, tiers=[{"type": "disk", "path": str(served.store.parent / "keys")}])
    engine = build_cache_engine(
        model_config=ModelConfig(str(served.model)),
        k_pool=layers,
        v_pool=layers,
        tp_rank=tp_rank,
        tp_size=TP,
        config=config,
    )
    try:
        (first, *_) = engine.record_keys(engine.chunk_keys(prompt, include_partial=False))
    finally:
        engine.close()
    digest = digest_of(first)
    record = served.store / digest[:2] / f"{digest}.kvr"
    assert record.is_file(), record
    return record


def cold_then_warm(server: SGLangServer, prompt: list[int]) -> tuple[list[int], list[int]]:
    """SGLang's greedy outputs for ``prompt``: computed, then from its own device cache."""
    cold, _, meta = server.generate(prompt)
    assert meta["cached_tokens"] == 0, meta
    warm, _, meta = server.generate(prompt)
    assert meta["cached_tokens"] >= WHOLE, meta
    return cold, warm


def host_hit(meta: dict[str, Any]) -> int:
    return int((meta.get("cached_tokens_details") or {}).get("host", 0))


def test_a_tensor_parallel_server_loads_what_it_stored_and_recomputes_what_one_rank_cannot_load(
    served: Served, tmp_path: Path
) -> None:
    server, sockets = served.server, served.sockets
    ranks = run_ctl(sockets, "list")["ranks"]
    assert sorted(r["tp_rank"] for r in ranks) == list(range(TP)), ranks  # every rank answers

    references = {}
    for prompt in (STORED, ONE_RANK_CORRUPT, ONE_RANK_MISSING):
        references[tuple(prompt)] = cold_then_warm(server, prompt)
        wait_stored(served, tmp_path, prompt)
    server.flush_cache()

    # both ranks load their heads' chunks: the output is SGLang's own from its device cache
    out, _, meta = server.generate(STORED)
    assert host_hit(meta) == WHOLE, meta
    assert out == references[tuple(STORED)][1]

    # one rank's record of the first chunk is corrupt (found when loading: rank 1), or gone (found
    # by its lookup: rank 0): the other rank's load must not go ahead alone (its heads' KV loaded,
    # the other's left as whatever its slots held): both recompute
    record = rank_record(served, ONE_RANK_CORRUPT, tp_rank=TP - 1)
    computed = record.read_bytes()
    record.write_bytes(computed[:-8] + bytes(b ^ 0xFF for b in computed[-8:]))
    rank_record(served, ONE_RANK_MISSING, tp_rank=0).unlink()
    for prompt in (ONE_RANK_CORRUPT, ONE_RANK_MISSING):
        out, _, meta = server.generate(prompt)
        assert meta["cached_tokens"] == 0, meta
        assert out == references[tuple(prompt)][0]  # computed from scratch, as SGLang did at first
        wait_stored(served, tmp_path, prompt)  # each rank stores again what it lost
    # the rank found its record corrupt and dropped it: what it stored after recomputing is the
    # KV it computed the first time, bit for bit
    assert record.read_bytes() == computed
    # the server still serves, and loads what both ranks hold
    server.flush_cache()
    out, _, meta = server.generate(STORED)
    assert host_hit(meta) == WHOLE, meta
    assert out == references[tuple(STORED)][1]

    # kvplug ctl clear reaches every rank
    cleared = run_ctl(sockets, "clear", "--all")["ranks"]
    assert sorted(r["tp_rank"] for r in cleared) == list(range(TP)), cleared
    assert all(r["removed"]["0:disk"] > 0 for r in cleared), cleared
    assert lookup(sockets, tmp_path, STORED) == [0] * TP
