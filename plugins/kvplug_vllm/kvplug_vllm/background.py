"""Background loads: fetch a cached prefix from a slow tier while vLLM keeps scheduling.

vLLM's asynchronous loading (``load_async=True`` from ``get_num_new_matched_tokens``)
parks the request in ``WAITING_FOR_REMOTE_KVS`` with its blocks allocated, and asks
the worker each step which loads are done (``get_finished``). Here the slow part,
fetching and checksumming the chunks (``CacheEngine.retrieve_layerwise``), runs on
a small thread pool; writing them into the paged cache is left to vLLM's own thread
between two forward passes (:meth:`WorkerSide.get_finished`), so it never races a
forward pass on the same device stream.

A fetch still running at its deadline is given up: its request is reported finished
with every promised block in error, vLLM recomputes them, and the late result is
dropped unwritten.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from kvplug import CacheEngine, ChunkKey, LayerwiseRetrieve, slots_from_block_ids
from kvplug_vllm.kv_groups import first_real_token
from kvplug_vllm.metadata import RequestMeta

logger = logging.getLogger("kvplug.vllm")

#: Fetches in flight at once; each is I/O bound (tier round trips, checksums).
FETCH_THREADS = 4


def fetch(
    engine: CacheEngine,
    request: RequestMeta,
    kv_caches: Sequence[torch.Tensor],
    keys: Sequence[ChunkKey] | None = None,
) -> LayerwiseRetrieve:
    """Fetch and verify the chunks ``request.load`` promised; iterate the result to write them.
    ``keys``: the chunk keys of the promised tokens, when the caller computed them already."""
    assert request.load is not None
    tokens = request.token_ids[: request.load.num_hit]
    mask = torch.ones(len(tokens), dtype=torch.bool)
    # A sliding-window group's table starts with vLLM's null block out of the window: not written.
    mask[: max(request.load.num_computed, first_real_token(request.block_ids, engine.layout.block_size))] = False
    slots = slots_from_block_ids(request.block_ids, engine.layout.block_size, len(tokens))
    return engine.retrieve_layerwise(tokens, kv_caches, slots, mask, request=request.request_info(), keys=keys)


@dataclass
class GroupTimings:
    """Where a load of several KV cache groups spent its time, summed over the groups."""

    fetch_s: float = 0.0
    verify_s: float = 0.0
    write_s: float = 0.0


class GroupsRetrieve:
    """The fetched chunks of every KV cache group of one request (a hybrid model).

    Each group loads its own block ids from the first token whose block is allocated
    (a sliding-window group: the window before the hit; the null block is never
    written), so each group's part of the promise starts there.
    """

    def __init__(self, parts: list[tuple[LayerwiseRetrieve, int]]) -> None:
        self.parts = parts

    def write_remaining(self) -> None:
        for retriever, _ in self.parts:
            retriever.write_remaining()

    def complete(self, end: int) -> bool:
        """Whether every group loaded its tokens up to ``end``."""
        return all(bool(r.loaded_mask[first:end].all()) for r, first in self.parts)

    @property
    def timings(self) -> GroupTimings:
        total = GroupTimings()
        for retriever, _ in self.parts:
            total.fetch_s += retriever.timings.fetch_s
            total.verify_s += retriever.timings.verify_s
            total.write_s += retriever.timings.write_s
        return total


def fetch_groups(
    groups: Sequence[tuple[int, CacheEngine, Sequence[torch.Tensor]]],
    request: RequestMeta,
    group_block_ids: Sequence[Sequence[int]],
) -> GroupsRetrieve:
    """Fetch every group's chunks of ``request.load`` into that group's own blocks
    (``group_block_ids``, one list per entry of ``groups``, in the engine's block size)."""
    assert request.load is not None
    tokens = request.token_ids[: request.load.num_hit]
    parts = []
    for (_, engine, caches), block_ids in zip(groups, group_block_ids):
        block_ids = list(block_ids)
        first = min(len(tokens), max(request.load.num_computed, first_real_token(block_ids, engine.layout.block_size)))
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:first] = False
        slots = slots_from_block_ids(block_ids, engine.layout.block_size, len(tokens))
        parts.append((engine.retrieve_layerwise(tokens, caches, slots, mask, request=request.request_info()), first))
    return GroupsRetrieve(parts)


@dataclass
class _Pending:
    request: RequestMeta
    future: Future[Any]
    started: float
    deadline: float


class BackgroundLoads:
    """Fetches in flight, by request id, each with a deadline."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: dict[str, _Pending] = {}
        self._pool: ThreadPoolExecutor | None = None

    def start(
        self,
        engine: CacheEngine,
        request: RequestMeta,
        kv_caches: Sequence[torch.Tensor],
        keys: Sequence[ChunkKey] | None = None,
    ) -> None:
        self.start_fetch(request, lambda: fetch(engine, request, kv_caches, keys))

    def start_fetch(self, request: RequestMeta, fetcher: Callable[[], Any]) -> None:
        """Run ``fetcher`` (returns a retriever: :class:`LayerwiseRetrieve` or :class:`GroupsRetrieve`)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="kvplug-load")
        future = self._pool.submit(fetcher)
        now = time.monotonic()
        self._pending[request.req_id] = _Pending(request, future, now, now + self.timeout_s)

    def wait(self, timeout_s: float) -> None:
        """Block until a load in flight is over, or ``timeout_s`` passed (releases the GIL)."""
        if self._pending:
            futures.wait([p.future for p in self._pending.values()], timeout_s, futures.FIRST_COMPLETED)

    def collect(self) -> list[tuple[RequestMeta, Any, float]]:
        """Loads that are over: fetched (a retriever to write), or failed / late (None),
        with the seconds since they started."""
        now = time.monotonic()
        over: list[tuple[RequestMeta, Any, float]] = []
        for req_id, pending in list(self._pending.items()):
            if pending.future.done():
                try:
                    over.append((pending.request, pending.future.result(), now - pending.started))
                except Exception:
                    logger.exception("request %s: background load failed; its blocks will be recomputed", req_id)
                    over.append((pending.request, None, now - pending.started))
            elif now >= pending.deadline:
                pending.future.cancel()
                logger.warning(
                    "request %s: background load still running after %.1f s (load_timeout_s); "
                    "its blocks will be recomputed", req_id, self.timeout_s,
                )  # fmt: skip
                over.append((pending.request, None, now - pending.started))
            else:
                continue
            del self._pending[req_id]
        return over

    def pending(self) -> int:
        return len(self._pending)

    def close(self) -> None:
        """Drop what is in flight: queued fetches are cancelled, running ones (bounded by
        their tiers' own deadlines) are waited for and discarded."""
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
