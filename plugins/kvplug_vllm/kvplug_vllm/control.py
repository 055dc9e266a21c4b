"""``kvplug ctl`` for vLLM: each worker serves its cache engine's control socket.

Every tensor-parallel rank's worker starts a :class:`kvplug.ControlServer` for its
engine, under vLLM's ``kv_transfer_config.engine_id`` (shared by the ranks of one
engine) and the served model name, whether the scheduler asks that worker over the
lookup socket or directly (``LLM`` in one process): ``kvplug ctl`` works the same way.
"""

from __future__ import annotations

import logging
from typing import Any

from kvplug import CacheEngine, ControlIdentity, ControlServer

logger = logging.getLogger("kvplug.vllm")


def start_control(engine: CacheEngine, vllm_config: Any, engine_key: tuple[str, int, int]) -> ControlServer | None:
    """The worker's control server, or ``None`` (logged) if it cannot start: an engine
    without ``kvplug ctl`` still serves."""
    engine_id, dp_rank, tp_rank = engine_key
    names = getattr(vllm_config.model_config, "served_model_name", None) or vllm_config.model_config.model
    name = names[0] if isinstance(names, (list, tuple)) else str(names)
    identity = ControlIdentity(
        engine_id=engine_id,
        name=name,
        adapter="vllm",
        tp_rank=tp_rank,
        tp_size=vllm_config.parallel_config.tensor_parallel_size,
        dp_rank=dp_rank,
    )
    try:
        server = ControlServer(engine, identity)
    except Exception as exc:
        logger.warning("kvplug ctl is not available for this worker: %s", exc)
        return None
    logger.info("kvplug ctl: engine %s (%s) rank tp%d answers on %s", engine_id, name, tp_rank, server.path)
    return server
