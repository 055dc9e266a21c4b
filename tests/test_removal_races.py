"""A removal and the write queue of an async tier: a chunk cleared while its write is still
queued (or being written) must not reach the tier afterwards.

Real engine, real cpu and disk tiers, a real control server and ``kvplug ctl clear``. The
disk tier's ``put`` is held at a gate the test opens: a slow disk, so that a store's write
is still in the chain's queue when the clear comes.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, random_caches
from typer.testing import CliRunner

from kvplug import CacheEngine, ControlIdentity, ControlServer, Fingerprint, RequestInfo, StorageTier, load_config
from kvplug.cli.main import app

LAYOUT = LAYOUTS["vllm_flash"]  # float16, block 4
FIRST = list(range(100, 116))  # two chunks of 8
SECOND = list(range(500, 516))


class SlowPuts:
    """Holds a real tier's ``put`` at ``gate``: its write queue fills behind the held write."""

    def __init__(self, tier: StorageTier) -> None:
        self.gate = threading.Event()
        self.entered = threading.Event()
        real_put = tier.put

        def put(items: Any) -> None:
            self.entered.set()
            assert self.gate.wait(60), "the test never opened the gate"
            real_put(items)

        tier.put = put  # type: ignore[method-assign]


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[CacheEngine]:
    tiers = [
        {"type": "cpu", "max_bytes": "64MiB"},
        {"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "64MiB", "queue": {"mode": "async"}},
    ]
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")) as cache:
        yield cache


def store(engine: CacheEngine, tokens: list[int]) -> list[str]:
    engine.store(tokens, random_caches(LAYOUT, 80), torch.arange(len(tokens)))
    return [key.key for key in engine.chunk_keys(tokens, RequestInfo())]


def test_ctl_clear_removes_chunks_whose_disk_writes_were_still_queued(engine: CacheEngine, socket_dir: Path) -> None:
    cpu, disk = engine.chain.tiers
    slow = SlowPuts(disk)
    server = ControlServer(engine, ControlIdentity("engine-a", "tiny", "test", tp_rank=0, tp_size=1))
    first = store(engine, FIRST)
    assert slow.entered.wait(30)  # the first prompt's disk write is in progress, held
    second = store(engine, SECOND)  # queued behind it
    opener = threading.Timer(0.3, slow.gate.set)  # the held write lands while the clear runs
    opener.start()
    try:
        result = CliRunner().invoke(app, ["ctl", "clear", "--all", "--json"])
        assert result.exit_code == 0, result.output
        cleared = json.loads(result.output)["total"]
    finally:
        opener.join()
        server.close()
    engine.flush()  # whatever the queue still held has been written now
    assert disk.contains(first + second) == [False] * 4, "a cleared chunk came back from the write queue"
    assert cpu.contains(first + second) == [False] * 4
    assert engine.lookup(FIRST) == 0 and engine.lookup(SECOND) == 0
    assert cleared["removed"] == {"0:cpu": 4, "1:disk": 4}
