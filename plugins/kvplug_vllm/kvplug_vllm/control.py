"""``kvplug ctl`` for vLLM: each worker serves its cache engine's control socket.

Every worker (each tensor-parallel rank of each pipeline stage) starts a :class:`kvplug.ControlServer` for its
engine, under vLLM's ``kv_transfer_config.engine_id`` (shared by the ranks of one
engine) and the served model name. The same socket answers the scheduler's lookups and
cache resets in vLLM's multiprocess engine (:mod:`kvplug_vllm.lookup`); ``LLM`` in one
process calls the engine directly, and ``kvplug ctl`` works the same way.

A hybrid model's worker answers for all of its KV cache groups (:class:`HybridControl`):
``lookup`` is cut as the engine's own lookups are, and ``clear`` removes every group's records
(of those this worker only loaded, only the copies in its private tiers, as for any engine).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvplug import CacheEngine, ChunkLocation, ControlIdentity, ControlServer, EngineControl, RequestInfo
from kvplug_vllm.group_engines import GroupEngines
from kvplug_vllm.settings import resets

logger = logging.getLogger("kvplug.vllm")


class HybridControl(EngineControl):
    """``kvplug ctl`` over a hybrid model's engines: the primary group's engine answers as for
    any model (explain's chunk map), the other groups' engines are its companions (the
    journal notes their stores and loads too: ``clear`` removes their records in its scope,
    of those this worker only loaded the copies in its private tiers alone), and a ``lookup``
    is cut to the last chunk end with a stored state, as the scheduler's lookups are
    (:class:`~kvplug_vllm.state_groups.StateBoundaries`)."""

    def __init__(self, engine: CacheEngine, groups: GroupEngines) -> None:
        super().__init__(engine, [other for index, other, _ in groups.groups if index != groups.primary_index])
        self.groups = groups

    def locate(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation]:
        found = super().locate(tokens, request)
        return found if self.groups.trim is None else self.groups.trim(tokens, request, found)


def start_control(
    engine: CacheEngine | EngineControl,
    vllm_config: Any,
    engine_key: tuple[str, int, int],
    *,
    on_reset: Callable[[], int] | None = None,
) -> ControlServer | None:
    """The worker's control server, or ``None`` (logged) if it cannot start: an engine
    without ``kvplug ctl`` (and, in vLLM's multiprocess engine, without kvplug hits: its
    scheduler's lookups are misses) still serves. ``on_reset``: the worker's cache reset."""
    engine_id, dp_rank, worker = engine_key
    parallel = vllm_config.parallel_config
    names = getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model
    name = names[0] if isinstance(names, (list, tuple)) else str(names)
    identity = ControlIdentity(
        engine_id=engine_id,
        name=name,
        adapter="vllm",
        tp_rank=worker % parallel.tensor_parallel_size,
        tp_size=parallel.tensor_parallel_size,
        dp_rank=dp_rank,
        pp_rank=worker // parallel.tensor_parallel_size,
        pp_size=parallel.pipeline_parallel_size,
    )
    try:
        server = ControlServer(engine, identity, on_reset=on_reset)
    except Exception as exc:
        logger.warning("kvplug ctl is not available for this worker: %s", exc)
        return None
    rank = f"pp{identity.pp_rank}/tp{identity.tp_rank}" if identity.pp_size > 1 else f"tp{identity.tp_rank}"
    logger.info("kvplug ctl: engine %s (%s) rank %s answers on %s", engine_id, name, rank, server.path)
    return server


def reset_tiers(engine: CacheEngine, target: EngineControl, reset_tiers: list[str] | None) -> int:
    """Remove a worker's chunks, of every KV cache group, from the ``reset_tiers`` tiers (by
    default the in-memory ones, told by their ``medium``); returns how many records went.

    As ``kvplug ctl clear``: from a private tier (``trusted_reads``: this process's memory) every
    chunk the worker stored or loaded; from a tier other engines may share (``shm``) only the
    records this worker's writes put there, never what another engine wrote. Through the chain's
    one removal path, so a queued write of a removed chunk is cancelled, not written after."""
    tiers = engine.chain.tiers
    chosen = [index for index, tier in enumerate(tiers) if resets(tier, reset_tiers)]
    _, done = target.remove(target.planned_clear, tiers=chosen)
    return len({key for removal in done for key in (*removal.removed, *removal.cancelled)})
