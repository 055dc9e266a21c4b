"""A hybrid model's cache engines: one per KV cache group, all writing into the same tiers.

The worker builds the primary group's engine (the one that answers lookups,
:func:`~kvplug_vllm.kv_groups.primary_group`) as for any model; :class:`GroupEngines` adds
one engine per other group, and stores and loads every group with its own block ids:
token-KV groups (full, sliding) by their block tables, recurrent-state groups by the
states vLLM hands over (:mod:`kvplug_vllm.state_groups`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvplug import CacheEngine, HeadShard, KVPlugConfig, slots_from_block_ids
from kvplug_vllm.background import GroupsRetrieve, fetch_groups
from kvplug_vllm.kv_groups import KVGroup, check_block_size, first_stored_token
from kvplug_vllm.layout import detect_layout, fingerprint_for, head_shard
from kvplug_vllm.metadata import RequestMeta
from kvplug_vllm.state_groups import StateBoundaries, state_layout, state_load_block_ids, state_pages, state_store_calls


class GroupEngines:
    """Every KV cache group's engine and caches, by group index."""

    def __init__(
        self,
        kv_groups: list[KVGroup],
        primary: tuple[int, CacheEngine, list[torch.Tensor]],
        all_caches: Mapping[str, Any],
        config: KVPlugConfig,
        vllm_config: Any,
        *,
        tp_rank: int,
        pp_rank: int,
    ) -> None:
        self.block_size = int(vllm_config.cache_config.block_size)
        self.groups: list[tuple[int, CacheEngine, list[torch.Tensor]]] = [primary]
        #: The recurrent-state groups among them.
        self.state_groups = {g.index for g in kv_groups if g.kind == "state"}
        count = len(kv_groups)
        for group in kv_groups:
            if group.index == primary[0]:
                continue
            caches: list[Any] = [all_caches[name] for name in group.layer_names]
            heads: HeadShard | None
            if group.kind == "state":  # a rank's own state (GDN shards it by head): keyed by rank
                caches = state_pages(caches, group.layer_names, config.chunk_size)
                layout, heads = state_layout(caches, config.chunk_size), None
            else:
                layout = detect_layout(dict(zip(group.layer_names, caches)), vllm_config)
                check_block_size(group, layout.block_size)
                heads = head_shard(layout, vllm_config, config.heads_per_record, tp_rank=tp_rank)
            described = group.describe(count) + (f"[{group.state_format}]" if group.state_format else "")
            fingerprint = fingerprint_for(layout, vllm_config, kv_group=described, tp_rank=tp_rank, pp_rank=pp_rank)
            engine = CacheEngine(config, layout, fingerprint, heads=heads, shares_tiers_with=primary[1])
            self.groups.append((group.index, engine, caches))
        self.groups.sort(key=lambda g: g[0])
        self.primary_index = primary[0]
        #: Cuts lookups to a chunk end with a stored state (None: no state group).
        self.trim = (
            StateBoundaries([e for i, e, _ in self.groups if i in self.state_groups]) if self.state_groups else None
        )

    def store(self, request: RequestMeta, tokens: list[int]) -> None:
        """Store every group's chunks from its own blocks (a sliding-window group's chunks from
        the first without a leading null block, out of its window; a state group: the states
        handed over)."""
        for index, engine, caches in self.groups:
            if index in self.state_groups:
                self._store_states(request, index, engine, caches)
                continue
            if request.save_end <= request.save_start:
                continue
            block_ids = request.group_block_ids[index]
            mask = torch.ones(len(tokens), dtype=torch.bool)
            mask[: first_stored_token(request.save_start, block_ids, engine.layout.block_size, engine.chunk_size)] = (
                False
            )
            slots = slots_from_block_ids(block_ids, engine.layout.block_size, len(tokens))
            engine.store(tokens, caches, slots, mask, request=request.request_info())

    def _store_states(self, request: RequestMeta, index: int, engine: CacheEngine, caches: list[torch.Tensor]) -> None:
        """Store the states vLLM handed over this step, each as the chunk that ends at its boundary."""
        handed = [(boundary, block) for group, block, boundary in request.state_blocks if group == index]
        tokens = request.token_ids
        for boundary, block_ids in state_store_calls(handed, len(tokens), engine.chunk_size):
            mask = torch.ones(boundary, dtype=torch.bool)
            mask[: boundary - engine.chunk_size] = False
            slots = slots_from_block_ids(block_ids, engine.chunk_size, boundary)
            engine.store(tokens[:boundary], caches, slots, mask, request=request.request_info())

    def fetch(self, request: RequestMeta) -> GroupsRetrieve:
        """Fetch every group's chunks of ``request.load`` (runs in the background: a group
        that cannot load fails the request, and vLLM recomputes it)."""
        return fetch_groups(self.groups, request, self._load_block_ids(request))

    def _load_block_ids(self, request: RequestMeta) -> list[list[int]]:
        """Each group's blocks for a load (a state group: the block at the hit boundary)."""
        assert request.load is not None
        return [
            state_load_block_ids(
                request.group_block_ids[index], request.load.num_hit, engine.chunk_size, self.block_size
            )
            if index in self.state_groups
            else request.group_block_ids[index]
            for index, engine, _ in self.groups
        ]

    def close(self, primary: CacheEngine) -> None:
        """Close every group's engine but ``primary`` (the worker closes its own)."""
        for _, engine, _ in self.groups:
            if engine is not primary:
                engine.close(drain=True)  # before the engine that owns the tiers they store into
        self.groups = []
