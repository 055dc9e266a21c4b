"""The SGLang KV connector API (LMCache's ``sglang_adapter``), backed by kvplug.

``KVPlugConnector`` stores and loads the KV of token ids at slot indices of an
SGLang ``MHATokenToKVPool`` (its per-layer ``k_buffer``/``v_buffer`` lists);
``KVPlugLayerwiseConnector`` loads layer by layer so an engine can overlap the
load of layer ``l + 1`` with the compute of layer ``l``, and makes every
tensor-parallel rank load the same number of tokens.

Slot conventions (as in LMCache's adapter):

- ``StoreMetadata.kv_indices`` has one slot per token id; ``offset`` tokens at the
  front were stored before and are skipped.
- ``LoadMetadata.slot_mapping`` has one slot per token id *after* ``offset``; the
  first ``offset`` tokens are already in the device pool.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import kvplug
from kvplug.errors import LayoutError
from kvplug_sglang.events import KVEventBridge
from kvplug_sglang.page_identity import weights_keys
from kvplug_sglang.setup_engine import build_cache_engine

logger = logging.getLogger("kvplug.sglang")


@dataclass
class StoreMetadata:
    """What to store: ``token_ids`` whose KV sits at ``kv_indices`` (same length)."""

    last_node: object
    token_ids: list[int]
    kv_indices: torch.Tensor
    offset: int
    request_id: str = ""
    cache_salt: str | None = None


@dataclass
class LoadMetadata:
    """What to load: ``token_ids``, of which ``offset`` are on device; ``slot_mapping``
    gives a destination slot for each of the other ``len(token_ids) - offset``."""

    token_ids: list[int]
    slot_mapping: torch.Tensor
    offset: int
    prefix_pad: int = 0
    request_id: str = ""
    cache_salt: str | None = None


class KVPlugConnector:
    """kvplug behind the connector API SGLang adapters know from LMCache.

    ``sgl_config`` is SGLang's ``ModelConfig`` (or anything with ``model_path``,
    ``num_hidden_layers`` and ``get_num_kv_heads``); ``k_pool``/``v_pool`` are
    the device pool's ``k_buffer``/``v_buffer`` lists. kvplug's config comes from
    ``engine_extra`` (``{"kvplug": {...}}`` or ``kvplug.``-prefixed keys), else
    ``KVPLUG_CONFIG`` (YAML) and ``KVPLUG_*`` variables.
    """

    def __init__(
        self,
        sgl_config: Any,
        tp_size: int,
        rank: int,
        k_pool: Sequence[torch.Tensor],
        v_pool: Sequence[torch.Tensor],
        *,
        page_size: int = 1,
        engine_extra: dict[str, Any] | None = None,
        config: kvplug.KVPlugConfig | None = None,
    ) -> None:
        self.sgl_config = sgl_config
        self.tp_size = tp_size
        self.rank = rank
        self.engine = build_cache_engine(
            model_config=sgl_config,
            k_pool=k_pool,
            v_pool=v_pool,
            tp_rank=rank,
            tp_size=tp_size,
            page_size=page_size,
            config=config,
            engine_extra=engine_extra,
        )
        self.kv_caches = list(zip(k_pool, v_pool))
        self.num_layers = len(self.kv_caches)
        self.device = k_pool[0].device
        self.events = KVEventBridge(
            {tier.name: tier.medium for tier in self.engine.chain.tiers}, in_flight=self.engine.writes_in_flight
        )
        self.engine.add_event_listener(self.events.observe)
        #: The engine's journal of what it stored and loaded, and where its chain wrote each.
        self.journal = kvplug.EngineControl(self.engine)

    # --- API --------------------------------------------------------------------------

    def chunk_size(self) -> int:
        return self.engine.chunk_size

    def load_kv(self, meta: LoadMetadata) -> int:
        """Load the cached part of ``token_ids[offset:]``; returns tokens loaded.

        The count is of whole chunks (or up to the end of the prompt) and stops at
        the first missing or corrupt chunk: what is reported loaded is correct.
        """
        tokens, slots, mask = self._load_args(meta)
        self._expect_events(tokens, meta.cache_salt)  # a hit in a slow tier is promoted: stored in a faster one
        loaded = self.engine.retrieve(tokens, self.kv_caches, slots, mask, request=_request(meta.cache_salt))
        return int(loaded.sum())

    def store_kv(self, meta: StoreMetadata) -> None:
        """Copy the KV of ``token_ids`` out of the pool now; tiers are written in the background."""
        tokens, slots, mask = self._store_args(meta)
        self._expect_events(tokens, meta.cache_salt)
        self.engine.store(tokens, self.kv_caches, slots, mask, request=_request(meta.cache_salt))

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Tokens of ``token_ids`` kvplug could load (whole chunks, or all of them)."""
        return self.engine.lookup(list(token_ids), request=_request(cache_salt))

    def get_kv_events(self) -> list[Any]:
        """``BlockStored``/``BlockRemoved`` events (``sglang.srt.disaggregation.kv_events``) since the last call."""
        return self.events.take()

    def flush(self) -> None:
        """Wait until every store so far is readable from every tier."""
        self.engine.flush()

    def reset(self) -> None:
        """Remove this connector's chunks as ``kvplug ctl clear`` does: what it stored, from the
        tiers its writes put them in (queued writes cancelled); what it only loaded, from its
        private tiers alone, never another engine's records in a shared tier."""
        self.journal.remove(self.journal.planned_clear)

    def close(self) -> None:
        self.journal.close()
        self.engine.remove_event_listener(self.events.observe)
        self.engine.close()

    # --- helpers ----------------------------------------------------------------------

    def _load_args(self, meta: LoadMetadata) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        tokens = _token_list(meta.token_ids)
        offset = _check_offset(meta.offset, len(tokens))
        slot_mapping = meta.slot_mapping.reshape(-1).to(torch.long)
        if slot_mapping.numel() != len(tokens) - offset:
            raise LayoutError(
                f"slot_mapping has {slot_mapping.numel()} slots; it needs one per token after offset "
                f"({len(tokens)} - {offset} = {len(tokens) - offset})"
            )
        slots = torch.cat([torch.zeros(offset, dtype=torch.long, device=slot_mapping.device), slot_mapping])
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:offset] = False
        return tokens, slots, mask

    def _store_args(self, meta: StoreMetadata) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        tokens = _token_list(meta.token_ids)
        offset = _check_offset(meta.offset, len(tokens))
        slots = meta.kv_indices.reshape(-1).to(torch.long)
        if slots.numel() != len(tokens):
            raise LayoutError(f"kv_indices has {slots.numel()} slots for {len(tokens)} token ids; they must match")
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:offset] = False
        return tokens, slots, mask

    def _expect_events(self, tokens: list[int], cache_salt: str | None) -> None:
        config = self.engine.config
        keys = self.engine.chunk_keys(tokens, _request(cache_salt), include_partial=config.save_unfull_chunk)
        self.events.expect([k.key for k in keys], [(k.start, k.end) for k in keys], tokens, cache_salt)


class KVPlugLayerwiseConnector(KVPlugConnector):
    """Layer-by-layer loading, with every TP rank agreeing on the loaded length.

    ``start_load_kv`` fetches and verifies the cached chunks and writes layer 0;
    ``load_kv_layerwise(l)`` makes sure layers up to ``l + 1`` are written (call
    it as layer ``l`` starts computing). ``tp_group`` is the tensor-parallel
    process group (any backend; gloo works on CPU).

    The loads started before a forward belong to it alone: a forward that ends before its
    last layer (aborted) must not have its loads written into slots freed and reused since.
    ``cancel_loads()`` drops them; without it, the next ``start_load_kv`` after a forward
    began, or a ``load_kv_layerwise`` call that goes back to an earlier layer (a new
    forward), drops them too.
    """

    def __init__(self, *args: Any, tp_group: dist.ProcessGroup | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp_group = tp_group
        # [LayerwiseRetrieve, next layer it writes] of loads still in progress
        self._loads: list[list[Any]] = []
        #: The layer of the forward in progress (its last load_kv_layerwise call), -1: none.
        self._layer = -1

    @torch.no_grad()
    def global_min_tokens(
        self, local_tokens: int, tp_group: dist.ProcessGroup | None, device: torch.device | str
    ) -> int:
        """The smallest ``local_tokens`` over the ranks of ``tp_group`` (all_reduce MIN)."""
        if self.tp_size == 1:
            return local_tokens
        tensor = torch.tensor([local_tokens], dtype=torch.int64, device=device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=tp_group)
        return int(tensor.item())

    def start_load_kv(self, meta: LoadMetadata) -> int:
        """Fetch the hit, agree on its length over TP ranks, write layer 0; returns new tokens.

        Every rank must call this for the same request (it is a collective). A rank
        whose own hit is longer than the agreed one may write the surplus into its
        slots; those tokens are reported not loaded, so the engine recomputes them.
        """
        tokens, slots, mask = self._load_args(meta)
        if self._layer >= 0:  # a forward ran since the last start: its unfinished loads are stale
            self.cancel_loads()
        request = _request(meta.cache_salt)
        loading = None
        local = meta.offset
        try:
            hit = self.engine.lookup(tokens, request=request)
            if hit > meta.offset:
                loading = self.engine.retrieve_layerwise(
                    tokens[:hit], self.kv_caches, slots[:hit], mask[:hit], request=request
                )
                local = meta.offset + loading.num_loaded_tokens
        except Exception:
            # Never skip the collective below: the other ranks would hang in it.
            logger.exception("kvplug: start_load_kv failed locally; loading nothing")
            loading, local = None, meta.offset
        agreed = self.global_min_tokens(local, self.tp_group, self._collective_device())
        if agreed <= meta.offset or loading is None:
            return 0
        next(loading)  # layer 0
        if self.num_layers > 1:
            self._loads.append([loading, 1])
        return agreed - meta.offset

    def load_kv_layerwise(self, layer_id: int) -> None:
        """Write every started load's layers up to ``layer_id + 1``."""
        if layer_id <= self._layer:  # a new forward, and the last one never reached its end
            self.cancel_loads()
        self._layer = -1 if layer_id >= self.num_layers - 1 else layer_id
        last = min(layer_id + 1, self.num_layers - 1)
        for state in self._loads:
            while state[1] <= last:
                next(state[0])
                state[1] += 1
        self._loads = [state for state in self._loads if state[1] < self.num_layers]

    def cancel_loads(self) -> None:
        """Drop the loads of a forward that ended before its last layer: their slots may be
        freed and given to other requests, whose KV the rest of the load would overwrite."""
        if self._loads:
            logger.warning("kvplug: %d layer-wise loads of an unfinished forward dropped", len(self._loads))
        self._loads = []
        self._layer = -1

    def store_kv(self, meta: StoreMetadata) -> None:
        """Store layer by layer (each layer's copy is done before the next starts)."""
        tokens, slots, mask = self._store_args(meta)
        self._expect_events(tokens, meta.cache_salt)
        storing = self.engine.store_layerwise(tokens, self.kv_caches, slots, mask, request=_request(meta.cache_salt))
        for _ in storing:
            pass

    def _collective_device(self) -> torch.device:
        backend = dist.get_backend(self.tp_group) if dist.is_initialized() else "gloo"
        return self.device if backend == "nccl" else torch.device("cpu")


def _request(cache_salt: str | None) -> kvplug.RequestInfo | None:
    weights = weights_keys()  # weights SGLang updated in place: the old weights' chunks are misses
    return kvplug.RequestInfo(cache_salt=cache_salt, extra_keys=weights) if cache_salt or weights else None


def _token_list(token_ids: Any) -> list[int]:
    if isinstance(token_ids, torch.Tensor):
        return [int(t) for t in token_ids.reshape(-1).tolist()]
    return [int(t) for t in token_ids]


def _check_offset(offset: int, num_tokens: int) -> int:
    if not 0 <= offset <= num_tokens:
        raise LayoutError(f"offset must be in [0, {num_tokens}] (the number of token ids), got {offset}")
    return offset
