"""kvplug's stored and evicted chunks as vLLM KV events, on vLLM's own ZMQ publisher.

The test binds a ZMQ SUB socket on 127.0.0.1; the engine (vLLM's prefix cache on,
kvplug with a small cpu tier) connects its publisher to it. vLLM publishes its own
prefix cache's ``BlockStored`` events and, through the connector, kvplug's: one per
stored chunk and tier that holds it (``medium="cpu"``), carrying vLLM's hash of each block in
the chunk, and ``BlockRemoved`` with ``medium="cpu"`` when the tier evicts the chunk. A
disk tier whose admission declines every chunk stored once is never announced.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from conftest import P1, P3, kv_config
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

# several real engines per test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

CHUNK_BYTES = 65_632  # one 64-token chunk of the tiny model, serialized


class Subscriber:
    """Collects every event batch published to ``endpoint`` (bound here, on 127.0.0.1)."""

    def __init__(self) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        port = self.socket.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.batches: list[KVEventBatch] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while True:
            if poller.poll(100):
                *_, payload = self.socket.recv_multipart()
                self.batches.append(decoder.decode(payload))
            elif self._stop.is_set():  # stop only once what has arrived is read
                return

    def close(self) -> list[Any]:
        self._stop.set()
        self._thread.join(5)
        self.socket.close(linger=0)
        self.context.term()
        return [event for batch in self.batches for event in batch.events]


@pytest.fixture(scope="module")
def events(run_engine: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    subscriber = Subscriber()
    declining = {
        "type": "disk",
        "path": str(tmp_path_factory.mktemp("disk")),
        "admission": {"type": "frequency", "min_hits": 2},
    }
    tiers = [{"type": "cpu", "max_bytes": 5 * CHUNK_BYTES}, declining]
    kv = kv_config(**{"kvplug.tiers": tiers, "kvplug.lookup_channel": "direct"})
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": subscriber.endpoint}
    steps = [{"prompts": [{"tokens": P1}], "max_tokens": 4}, {"prompts": [{"tokens": P3}], "max_tokens": 4}]
    try:
        run_engine(kv=kv, steps=steps, prefix_caching=True, kv_events=kv_events)
    finally:
        yield subscriber.close()


def vllm_blocks(events: list[Any]) -> dict[Any, tuple[Any, list[int]]]:
    """vLLM's own prefix-cache blocks: hash -> (parent hash, the block's token ids)."""
    blocks = {}
    for event in events:
        if isinstance(event, BlockStored) and event.medium not in ("cpu", "disk"):
            parent = event.parent_block_hash
            for i, block_hash in enumerate(event.block_hashes):
                blocks[block_hash] = (parent, event.token_ids[i * event.block_size : (i + 1) * event.block_size])
                parent = block_hash
    return blocks


def test_stored_chunks_carry_vllm_block_hashes(events: list[Any]) -> None:
    theirs = vllm_blocks(events)
    ours = [e for e in events if isinstance(e, BlockStored) and e.medium == "cpu"]
    assert len(ours) == 4 + 3  # P1: 4 whole chunks of 64; P3: 3
    for event in ours:
        assert len(event.block_hashes) == 2  # 64-token chunk, 32-token blocks
        # the very hashes vLLM's own prefix cache published for the same tokens
        first, second = (theirs[h] for h in event.block_hashes)
        assert first == (event.parent_block_hash, event.token_ids[:32])
        assert second == (event.block_hashes[0], event.token_ids[32:])
    assert [e.token_ids for e in ours[:4]] == [P1[i : i + 64] for i in range(0, 256, 64)]


def test_evicted_chunks_are_removed_with_their_tier(events: list[Any]) -> None:
    stored_p1 = [h for e in events if isinstance(e, BlockStored) and e.medium == "cpu" for h in e.block_hashes][:8]
    removed = [h for e in events if isinstance(e, BlockRemoved) and e.medium == "cpu" for h in e.block_hashes]
    # 7 chunks into a 5-chunk tier: P1's oldest chunks are evicted (LRU), whole chunks, in order
    assert removed and len(removed) % 2 == 0
    assert removed == stored_p1[: len(removed)]


def test_a_tier_that_declined_the_chunks_is_never_announced(events: list[Any]) -> None:
    # P1 and P3 are each stored once: the disk tier's frequency admission declines every chunk.
    assert [e for e in events if isinstance(e, (BlockStored, BlockRemoved)) and e.medium == "disk"] == []
