"""One step's layer-wise loads and stores (``layerwise: true``), as the worker side runs them.

vLLM calls ``wait_for_layer_load(l)`` before layer ``l``'s attention reads the cache and
``save_kv_layer(l)`` after it wrote its KV. Each load writes its fetched chunks one layer
per call; each store copies one layer out per call and hands its chunks to the tiers after
the forward pass (``wait_for_save``).

A layer's write can still fail in the middle of the forward pass (a device copy error, or
a connector that raises): the load then counts as nothing loaded, so its promised blocks
are reported for recompute once the pass is over, and the request's stores of that step
are dropped: their KV was computed on top of the layers that did not load. A copy that
raises never reaches vLLM's forward pass: it is logged, and that load or store is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Generator

from kvplug import LayerwiseRetrieve
from kvplug_vllm.load_results import LoadResults
from kvplug_vllm.metadata import RequestMeta
from kvplug_vllm.stats import KVPlugConnectorStats

logger = logging.getLogger("kvplug.vllm")


class LayerwiseStep:
    """The step's layer-wise loads (each with the tokens it fetched) and stores, by request."""

    def __init__(self) -> None:
        #: Each load: its request, its retriever (None once a write raised), the tokens it fetched.
        self.loads: list[tuple[RequestMeta, LayerwiseRetrieve | None, int]] = []
        self.loaded_layers = 0
        self.stores: list[tuple[str, Generator[int, None, int]]] = []
        #: The stores were started (at the first layer's ``save_kv_layer``).
        self.storing = False
        self.saved_layers = 0

    def add_load(self, request: RequestMeta, retriever: LayerwiseRetrieve) -> None:
        self.loads.append((request, retriever, retriever.num_loaded_tokens))

    def load_through(self, index: int) -> None:
        """Write every load's layers up to ``index``."""
        while self.loaded_layers <= index:
            for position, (request, retriever, fetched) in enumerate(self.loads):
                if retriever is None:
                    continue
                try:
                    next(retriever, None)
                except Exception:
                    logger.exception(
                        "request %s: writing the loaded KV failed; its blocks will be recomputed", request.req_id
                    )
                    self.loads[position] = (request, None, fetched)
            self.loaded_layers += 1

    def store_through(self, index: int) -> None:
        """Copy every store's layers up to ``index`` out of the cache."""
        while self.saved_layers <= index:
            for req_id, storer in list(self.stores):
                try:
                    next(storer, None)
                except Exception:
                    logger.exception("request %s: storing failed; nothing stored for this step", req_id)
                    self.stores.remove((req_id, storer))
            self.saved_layers += 1

    def finish_loads(self, results: LoadResults, block_size: int, stats: KVPlugConnectorStats) -> None:
        """Write the layers the forward pass did not wait for; note the loads a write failed."""
        for request, retriever, fetched in self.loads:
            try:
                if retriever is not None:
                    retriever.write_remaining()
            except Exception:
                logger.exception(
                    "request %s: writing the loaded KV failed; its blocks will be recomputed", request.req_id
                )
                retriever = None
            if retriever is None or retriever.num_loaded_tokens < fetched:
                counted = request.req_id in results.failed_this_step  # its fetch fell short already
                results.poison(request)
                loaded = retriever.loaded_mask if retriever is not None else None
                results.check_blocks(request, loaded, block_size, KVPlugConnectorStats() if counted else stats)
        self.loads = []

    def finish_stores(self, failed: set[str]) -> None:
        """Hand the stores' chunks to the tiers, but those of requests whose load failed."""
        for req_id, storer in self.stores:
            if req_id in failed:
                storer.close()  # its frames go back to the pool
                continue
            try:
                for _ in storer:
                    pass
            except Exception:
                logger.exception("request %s: storing failed; nothing stored for this step", req_id)
        self.stores = []
