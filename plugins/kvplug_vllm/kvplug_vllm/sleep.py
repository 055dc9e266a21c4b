"""vLLM's sleep mode: the worker's KV caches leave (``unregister_kv_caches``) and come back.

vLLM (0.33 and later) unmaps the KV cache's memory while the engine sleeps and maps new
memory on wake-up (``restore_kv_caches``). Until then any copy into or out of a cache
would touch unmapped or foreign memory, so while asleep every cache engine of the worker
copies through :class:`AsleepConnector`, which refuses: a store is dropped and a load is a
miss (vLLM recomputes), both through the engine's ordinary connector-error path. What holds
device addresses of the old caches (the ``cuda`` connector's addressing tables) is dropped
on unregister and rebuilt from the caches on their next use.

vLLM's sleep backend remaps the caches at their old virtual addresses, so the registered
tensors stay the worker's caches; a caller that has new tensors (another backend) passes
them to :meth:`CacheSleep.restore`, which puts them in place of the old ones in the list
every store and load reads the caches from.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch

from kvplug import CacheEngine, KVConnector
from kvplug.errors import ConnectorError, LayoutError

logger = logging.getLogger("kvplug.vllm")


class CachesAsleepError(ConnectorError):
    """A copy into or out of the KV caches was asked for while vLLM had them unregistered (sleep mode)."""


class CacheRemapError(LayoutError):
    """The caches handed back on wake-up do not match the ones registered (names, shapes, dtypes)."""


@runtime_checkable
class ReleasesCaches(Protocol):
    """A connector that keeps state derived from cache addresses (the ``cuda`` connector's tables)."""

    def release_caches(self) -> None: ...


class SleepingWorker(Protocol):
    """What :class:`CacheSleep` reads of :class:`kvplug_vllm.worker.WorkerSide`."""

    engine: CacheEngine | None
    kv_caches: list[torch.Tensor]
    layer_index: dict[str, int]
    groups: Any


class AsleepConnector(KVConnector):
    """Stands in for a cache engine's connector while vLLM sleeps: no copy touches a cache.

    Plans are the real connector's (they read slot numbers only), so a load fetched before
    the sleep and written after the wake-up is planned the same either way.
    """

    name: ClassVar[str] = "asleep"

    def __init__(self, awake: KVConnector) -> None:
        super().__init__(awake.config, awake.layout)
        self.awake = awake

    def wants_pinned_frames(self) -> bool:
        return self.awake.wants_pinned_frames()

    def plan(self, slots: torch.Tensor) -> Any:
        return self.awake.plan(slots)

    def plan_many(self, slots: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[Any]:
        return self.awake.plan_many(slots, spans)

    def gather_layer(self, layer_cache: Any, plan: Any, out: torch.Tensor) -> None:
        raise self._refusal("store")

    def scatter_layer(self, layer_cache: Any, plan: Any, src: torch.Tensor) -> None:
        raise self._refusal("load")

    def gather_copies(self, *args: Any, **kwargs: Any) -> list[Callable[[], None]]:
        raise self._refusal("store")

    def scatter_copies(self, *args: Any, **kwargs: Any) -> list[Callable[[], None]]:
        raise self._refusal("load")

    def _refusal(self, what: str) -> ConnectorError:
        return CachesAsleepError(
            f"{what} refused: vLLM unregistered its KV caches for sleep mode and has not restored them "
            "(restore_kv_caches after wake-up)"
        )


class CacheSleep:
    """Unregisters and restores one worker's KV caches around vLLM's sleep mode (idempotent both ways)."""

    def __init__(self) -> None:
        self.asleep = False

    def unregister(self, worker: SleepingWorker) -> None:
        """Stop every copy into or out of the caches and drop what holds their addresses."""
        if self.asleep or worker.engine is None:
            return
        # Background fetches in flight read tiers only; their writes into the caches go
        # through the engine's connector, which refuses them from here on (a miss).
        for engine in worker_engines(worker):
            awake = engine.connector
            try:
                awake.synchronize()  # copies issued before the sleep finish while their memory is mapped
            except ConnectorError:
                logger.exception("unregister_kv_caches: copies still in flight failed")
            if isinstance(awake, ReleasesCaches):
                awake.release_caches()
            engine.connector = AsleepConnector(awake)
        self.asleep = True
        logger.info("KV caches unregistered (sleep mode): stores are dropped and loads miss until they are restored")

    def restore(self, worker: SleepingWorker, kv_caches: Mapping[str, torch.Tensor] | None = None) -> None:
        """Copy through the caches again; ``kv_caches`` (by layer name) replace the registered ones."""
        if kv_caches is not None:
            self._replace(worker, kv_caches)
        if not self.asleep:
            return
        for engine in worker_engines(worker):
            # exactly the sleep's stand-in: one a weight reload put there (kvplug_vllm.weights) stays
            if type(engine.connector) is AsleepConnector:
                engine.connector = engine.connector.awake
        self.asleep = False
        logger.info("KV caches restored after sleep mode")

    def _replace(self, worker: SleepingWorker, kv_caches: Mapping[str, torch.Tensor]) -> None:
        missing = sorted(set(worker.layer_index) - set(kv_caches))
        if missing:
            raise CacheRemapError(f"restored KV caches lack layer(s) {missing[:4]} that were registered")
        changed = False
        for name, index in worker.layer_index.items():
            old, new = worker.kv_caches[index], kv_caches[name]
            if (new.shape, new.stride(), new.dtype, new.device) != (old.shape, old.stride(), old.dtype, old.device):
                raise CacheRemapError(
                    f"layer {name}: restored cache is {tuple(new.shape)}/{new.stride()} {new.dtype} on {new.device}, "
                    f"the registered one {tuple(old.shape)}/{old.stride()} {old.dtype} on {old.device}"
                )
            changed = changed or new is not old
        if changed and worker.groups is not None:
            raise CacheRemapError(
                "a hybrid model's KV cache groups keep views of the caches they were registered with: "
                "kvplug cannot follow new cache tensors for them (the same tensors, remapped in place, are fine)"
            )
        for name, index in worker.layer_index.items():
            # in place: loads fetched before the sleep hold this very list
            worker.kv_caches[index] = kv_caches[name]
        if changed:
            for engine in worker_engines(worker):
                connector = (
                    engine.connector.awake if isinstance(engine.connector, AsleepConnector) else engine.connector
                )
                if isinstance(connector, ReleasesCaches):
                    connector.release_caches()


def worker_engines(worker: SleepingWorker) -> list[CacheEngine]:
    """Every cache engine of ``worker``: its own and those of a hybrid model's other KV cache groups."""
    if worker.engine is None:
        return []
    engines = [worker.engine]
    if worker.groups is not None:
        engines += [engine for _, engine, _ in worker.groups.groups if engine is not worker.engine]
    return engines
