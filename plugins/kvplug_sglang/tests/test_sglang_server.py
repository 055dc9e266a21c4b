"""kvplug in a running SGLang server: ``python -m sglang.launch_server`` processes on 127.0.0.1.

On a machine without CUDA the servers run on the test-only CPU platform
(``tests/sglang_cpu_platform``, what SGLang 0.5.23 lacks to serve on a CPU); with
CUDA, on SGLang's own platform. Each test checks that the prefix comes back from
kvplug (not SGLang's own device cache, which ``/flush_cache`` empties, nor a new
process's) and that greedy outputs equal those of SGLang serving the same prompt
from its own radix cache. The model is a tiny random Llama written by the test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvplug_sglang.testing as sglang_kit
from kvplug.testing import held_port
from kvplug_sglang.testing import SGLangServer, hicache_args, kvplug_env, write_random_llama

# Each test starts two or three servers; a loaded 2-core machine takes minutes per start.
pytestmark = pytest.mark.timeout(1800)

PROMPT = list(range(100, 100 + 1500))  # not [10, 11, 12]: SGLang's warm-up request
MIN_HIT = int(0.8 * len(PROMPT))

Start = Callable[..., SGLangServer]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(write_random_llama(tmp_path_factory.mktemp("random-llama")))


@pytest.fixture
def serve(model_path: str, tmp_path: Path) -> Iterator[Start]:
    """Start servers (all at once, then wait); every one is stopped at the end of the test."""
    servers: list[SGLangServer] = []

    def start(extra_args: list[str], env: dict[str, str] | None = None) -> SGLangServer:
        server = SGLangServer(model_path, extra_args, env or {}, tmp_path / f"server{len(servers)}.log")
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def reference(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """SGLang on its own: the prompt cold, then again from SGLang's radix cache (and after a flush).

    Its start is also the kit's test of a port another process takes between the kit's choosing it
    and the server's bind (no start of its own: CI time): the first port the kit chooses is held
    (the race cannot be caused on demand), and the server starts again on another."""
    real_free_port = sglang_kit.free_port
    with held_port() as held, pytest.MonkeyPatch.context() as patch:
        choices = iter([held])
        patch.setattr(sglang_kit, "free_port", lambda: next(choices, None) or real_free_port())
        server = SGLangServer(model_path, [], {}, tmp_path_factory.mktemp("reference") / "server.log")
        assert server.port == held
        server.wait_healthy()
    assert server.port != held
    try:
        cold, _, _ = server.generate(PROMPT)
        warm, _, meta = server.generate(PROMPT)
        assert meta["cached_tokens"] >= MIN_HIT, f"SGLang's own radix cache did not hit: {meta}"
        server.flush_cache()
        flushed, _, meta = server.generate(PROMPT)
        assert meta["cached_tokens"] == 0, f"/flush_cache left SGLang's own cache warm: {meta}"
    finally:
        server.stop()
    assert flushed == cold
    return {"cold": cold, "warm": warm}


@pytest.fixture(scope="module")
def sglang_hicache_hash() -> None:
    """Build SGLang's HiCache page-hash extension before a HiCache server needs it.

    SGLang compiles it (a torch C++ extension, cached per machine) on the first storage
    lookup, in HiCache's prefetch thread; ``/flush_cache`` stops that thread and gives it
    10 s, so a flush during the first compile fails ("Failed to stop HiCache storage
    threads cleanly"). A first HiCache request on a fresh machine has the same wait.
    """
    from sglang.srt.mem_cache.utils import get_hash_str

    get_hash_str(list(range(64)), None, page_size=64)


def _kvplug_hit(meta: dict[str, Any], source: str) -> int:
    """Prefix tokens that came from below SGLang's device cache (``host`` or ``storage``)."""
    details = meta.get("cached_tokens_details") or {}
    return int(details.get(source, 0))


def _wait_until_stored(stored_amount: Callable[[], int], timeout_s: float = 120.0) -> None:
    """kvplug writes a finished request's KV on a background worker: wait until the
    store holds something and has stopped growing for a second (not a fixed sleep,
    which a loaded machine outlasts)."""
    deadline = time.monotonic() + timeout_s
    last, steady_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        amount = stored_amount()
        if amount != last:
            last, steady_since = amount, time.monotonic()
        elif amount > 0 and time.monotonic() - steady_since >= 1.0:
            return
        time.sleep(0.2)
    raise AssertionError(f"kvplug's store did not settle within {timeout_s} s (last amount {last})")


def _folder_bytes(folder: Path) -> Callable[[], int]:
    def total() -> int:
        size = 0
        for path in folder.rglob("*") if folder.exists() else []:
            try:
                size += path.stat().st_size if path.is_file() else 0
            except FileNotFoundError:  # a temporary file renamed into place meanwhile
                pass
        return size

    return total


def test_radix_backend_hits_after_flush_and_restart(serve: Start, reference: dict, tmp_path: Path) -> None:
    tiers = [{"type": "cpu", "max_bytes": "256MiB"}, {"type": "disk", "path": str(tmp_path / "kv")}]
    args, env = ["--radix-cache-backend", "kvplug"], kvplug_env(tiers)
    server = serve(args, env).wait_healthy()
    cold, _, meta = server.generate(PROMPT)
    assert cold == reference["cold"]
    assert meta["cached_tokens"] == 0, meta
    _wait_until_stored(_folder_bytes(tmp_path / "kv"))  # the last tier, written after the cpu tier
    server.flush_cache()
    warm, _, meta = server.generate(PROMPT)
    assert _kvplug_hit(meta, "host") >= MIN_HIT, f"not served from kvplug after /flush_cache: {meta}"
    assert meta["cached_tokens"] >= MIN_HIT
    assert warm == reference["warm"]
    server.stop()

    restarted = serve(args, env).wait_healthy()  # cpu tier gone with the process: disk serves
    again, _, meta = restarted.generate(PROMPT)
    assert _kvplug_hit(meta, "host") >= MIN_HIT, f"not served from kvplug's disk tier after a restart: {meta}"
    assert again == reference["warm"]


@pytest.mark.usefixtures("sglang_hicache_hash")
def test_hicache_storage_backend_hits_after_flush_and_restart(serve: Start, reference: dict, tmp_path: Path) -> None:
    args = hicache_args([{"type": "disk", "path": str(tmp_path / "l3")}])
    server = serve(args).wait_healthy()
    cold, _, _ = server.generate(PROMPT)
    assert cold == reference["cold"]
    _wait_until_stored(_folder_bytes(tmp_path / "l3"))
    server.flush_cache()
    warm, _, meta = server.generate(PROMPT)
    assert _kvplug_hit(meta, "storage") >= MIN_HIT, f"not served from KVPlugStorage after /flush_cache: {meta}"
    assert warm == reference["warm"]
    server.stop()

    restarted = serve(args).wait_healthy()
    again, _, meta = restarted.generate(PROMPT)
    assert _kvplug_hit(meta, "storage") >= MIN_HIT, f"not served from KVPlugStorage after a restart: {meta}"
    assert again == reference["warm"]


def test_two_servers_share_one_valkey_tier(serve: Start, reference: dict, tmp_path: Path) -> None:
    from kvplug_valkey.testing import ValkeyServer

    with ValkeyServer(tmp_path / "valkey") as valkey:
        env = kvplug_env([{"type": "cpu", "max_bytes": "256MiB"}, valkey.tier_options()])
        args = ["--radix-cache-backend", "kvplug"]
        first, second = serve(args, env), serve(args, env)  # both start at once
        first.wait_healthy()
        second.wait_healthy()
        cold, _, meta = first.generate(PROMPT)
        assert cold == reference["cold"] and meta["cached_tokens"] == 0, meta
        _wait_until_stored(lambda: int(valkey.cli("DBSIZE")))
        shared, _, meta = second.generate(PROMPT)
        assert _kvplug_hit(meta, "host") >= MIN_HIT, f"server 2 did not load server 1's prefix from valkey: {meta}"
        assert shared == reference["warm"]
        first.stop()  # before valkey goes away, so their exit-time flush finds it
        second.stop()
