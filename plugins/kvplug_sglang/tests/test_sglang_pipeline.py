"""kvplug's radix-cache backend in a real pipeline-parallel SGLang server (``--pp-size 2``).

One ``python -m sglang.launch_server`` with two pipeline stages, one scheduler process each
(one core each: ``SGLANG_CPU_OMP_THREADS_BIND``); the tiny model's two layers are one per
stage, and each stage stores its own record of every chunk (its fingerprint names its layers).
SGLang's stages each run their own scheduler and radix tree over the same requests and must
agree on every prefix length: a load one stage cannot do is recomputed by all of them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
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

pytestmark = pytest.mark.timeout(1200)

CHUNK = 64
WHOLE = 3 * CHUNK
#: One prompt per case; not [10, 11, 12] (SGLang's warm-up request).
STORED, ONE_STAGE_CORRUPT, ONE_STAGE_MISSING = ([1000 + 7 * p + i for i in range(WHOLE + 8)] for p in range(3))


@pytest.fixture(scope="module")
def pp_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SGLangServer, Path, Path, Path]]:
    """The server, its disk tier's folder, the model and its control sockets' folder."""
    folder = tmp_path_factory.mktemp("pp")
    model = write_random_llama(folder / "model")
    sockets = folder / "ctl"
    sockets.mkdir(mode=0o700)
    store = folder / "kv"
    env = {
        **kvplug_env([{"type": "disk", "path": str(store)}], chunk_size=CHUNK),
        "KVPLUG_LOOKUP_DIR": str(sockets),
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # one core per stage (SGLang asks one NUMA node per rank)
    }
    server = SGLangServer(str(model), ["--pp-size", "2", "--radix-cache-backend", "kvplug"], env, folder / "log")
    try:
        yield server.wait_healthy(), store, model, sockets
    finally:
        server.stop()


def lookup(sockets: Path, tmp_path: Path, prompt: list[int]) -> list[int]:
    """``kvplug ctl lookup``: each stage's hit, by pipeline stage."""
    path = tmp_path / "prompt.txt"
    path.write_text(" ".join(map(str, prompt)))
    ranks = run_ctl(sockets, "lookup", str(path))["ranks"]
    return [r["hit_tokens"] for r in sorted(ranks, key=lambda r: r["pp_rank"])]


def wait_stored(sockets: Path, tmp_path: Path, prompt: list[int]) -> None:
    """Each stage stores on its own background worker: wait until both hold the prompt."""
    deadline = time.monotonic() + 120
    while (hits := lookup(sockets, tmp_path, prompt)) != [WHOLE, WHOLE]:
        assert time.monotonic() < deadline, hits
        time.sleep(0.5)


def stage_record(store: Path, model: Path, prompt: list[int], stage: int) -> Path:
    """The file of stage ``stage``'s record of ``prompt``'s first chunk (keys as that stage makes them)."""
    from sglang.srt.configs.model_config import ModelConfig

    layer = [torch.zeros(8, 2, 32, dtype=torch.bfloat16)]  # one layer of the model's (2 KV heads of 32)
    config = kvplug.KVPlugConfig(chunk_size=CHUNK, tiers=[{"type": "disk", "path": str(store.parent / "keys")}])
    engine = build_cache_engine(
        model_config=ModelConfig(str(model)), k_pool=layer, v_pool=layer, config=config, first_layer=stage
    )
    try:
        (first, *_) = engine.record_keys(engine.chunk_keys(prompt, include_partial=False))
    finally:
        engine.close()
    digest = digest_of(first)
    record = store / digest[:2] / f"{digest}.kvr"
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


def test_a_pipeline_parallel_server_loads_what_it_stored_and_recomputes_what_one_stage_cannot_load(
    pp_server: tuple[SGLangServer, Path, Path, Path], tmp_path: Path
) -> None:
    server, store, model, sockets = pp_server
    ranks = run_ctl(sockets, "list")["ranks"]
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in ranks) == [(0, 0), (1, 0)], ranks  # both stages answer

    references = {}
    for prompt in (STORED, ONE_STAGE_CORRUPT, ONE_STAGE_MISSING):
        references[tuple(prompt)] = cold_then_warm(server, prompt)
        wait_stored(sockets, tmp_path, prompt)
    server.flush_cache()

    # every stage loads its layers' chunks: the output is SGLang's own from its device cache
    out, _, meta = server.generate(STORED)
    assert host_hit(meta) == WHOLE, meta
    assert out == references[tuple(STORED)][1]

    # one stage's record of the first chunk is corrupt (found when loading), or gone (found by its
    # lookup): the other stage's load must not go ahead alone; every stage recomputes the prompt
    record = stage_record(store, model, ONE_STAGE_CORRUPT, stage=1)
    computed = record.read_bytes()
    record.write_bytes(computed[:-8] + bytes(b ^ 0xFF for b in computed[-8:]))
    stage_record(store, model, ONE_STAGE_MISSING, stage=0).unlink()
    for prompt in (ONE_STAGE_CORRUPT, ONE_STAGE_MISSING):
        out, _, meta = server.generate(prompt)
        assert meta["cached_tokens"] == 0, meta
        assert out == references[tuple(prompt)][0]  # computed from scratch, as SGLang did at first
        wait_stored(sockets, tmp_path, prompt)  # each stage stores again what it lost
    # stage 1 found its record corrupt and dropped it: what it stored after recomputing is the
    # KV it computed the first time, bit for bit (its pool held no KV of the failed load)
    assert record.read_bytes() == computed
    # the server still serves, and loads what both stages hold
    server.flush_cache()
    out, _, meta = server.generate(STORED)
    assert host_hit(meta) == WHOLE, meta
    assert out == references[tuple(STORED)][1]

    # kvplug ctl clear reaches both stages
    cleared = run_ctl(sockets, "clear", "--all")["ranks"]
    assert sorted(r["pp_rank"] for r in cleared) == [0, 1], cleared
    assert all(r["removed"]["0:disk"] > 0 for r in cleared), cleared
    assert lookup(sockets, tmp_path, STORED) == [0, 0]
