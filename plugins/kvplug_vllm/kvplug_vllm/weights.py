"""vLLM's in-place weight reload (``reload_weights``): kvplug neither loads nor stores after one.

vLLM (0.32) reloads a model's weights in place (``Worker.reload_weights`` ->
``GPUModelRunner.reload_weights``, which the CPU model runner inherits; RL trainers and the
snapshot server call it through ``collective_rpc``) and resets only its LoRA, encoder and
multimodal caches: the connector hears nothing, and nothing in the model config that kvplug's
keys digest changes. From then on a chunk in the tiers under this engine's keys is the old
weights' KV (a wrong hit), and a chunk this engine stores is the new weights' KV under the
keys every server still on the old weights reads (poisoning a shared tier).

vLLM offers no hook, callback or weights version, so kvplug wraps ``reload_weights`` of the
model runner classes (once per process) and tells the worker whose ``vllm_config`` the
runner shares. That worker then stores nothing, and every cache engine of it copies through
:class:`WeightsReloadedConnector`, which refuses: a load promised by a lookup is a load
error, which vLLM recomputes (``kv_load_failure_policy: recompute``), through the same path as
any failed load. Restart the server, or give the new weights their own keys (a new model
revision, or a ``cache_salt`` per weights version), to use the cache again.
"""

from __future__ import annotations

import functools
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from kvplug.errors import ConnectorError
from kvplug_vllm.sleep import AsleepConnector, SleepingWorker, worker_engines

logger = logging.getLogger("kvplug.vllm")

#: The model runner classes whose ``reload_weights`` reloads in place (v1 runner, CPU included;
#: the v2 runner when this process uses it).
RUNNER_CLASSES = (
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"),
)

_WRAPPED = "__kvplug_reload_watch__"


class WeightsReloadedError(ConnectorError):
    """A copy into or out of the KV caches after vLLM reloaded the model's weights in place."""


class ReloadingWorker(SleepingWorker, Protocol):
    """What :func:`watch_reloads` reads and changes of :class:`kvplug_vllm.worker.WorkerSide`."""

    vllm_config: Any
    can_save: bool


class WeightsReloadedConnector(AsleepConnector):
    """Stands in for a cache engine's connector for good after a weight reload: no copy runs."""

    name: ClassVar[str] = "weights-reloaded"

    def _refusal(self, what: str) -> ConnectorError:
        return WeightsReloadedError(
            f"{what} refused: vLLM reloaded the model's weights in place, so kvplug's chunks under this "
            "engine's keys are the old weights' KV (restart, or use a new revision or cache_salt)"
        )


class _Watched:
    """The workers of this process, each told when a runner sharing its ``vllm_config`` reloads."""

    def __init__(self) -> None:
        self.workers: weakref.WeakSet[Any] = weakref.WeakSet()

    def reloading(self, vllm_config: Any) -> None:
        for worker in list(self.workers):
            if worker.vllm_config is vllm_config:
                weights_reloaded(worker)


_WATCHED = _Watched()


def watch_reloads(worker: ReloadingWorker) -> None:
    """Tell ``worker`` of every in-place weight reload of its model runner, from now on."""
    _WATCHED.workers.add(worker)
    for module_name, class_name in RUNNER_CLASSES:
        module = sys.modules.get(module_name)  # a runner this process uses is imported by now
        runner = getattr(module, class_name, None) if module is not None else None
        if runner is not None and not getattr(runner.reload_weights, _WRAPPED, False):
            runner.reload_weights = _watching(runner.reload_weights)


def _watching(reload: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(reload)
    def reload_weights(runner: Any, *args: Any, **kwargs: Any) -> None:
        # Before the reload: weights half loaded (or a reload that raised) are not the old ones either.
        _WATCHED.reloading(getattr(runner, "vllm_config", None))
        reload(runner, *args, **kwargs)

    setattr(reload_weights, _WRAPPED, True)
    return reload_weights


def weights_reloaded(worker: ReloadingWorker) -> None:
    """From now on ``worker`` stores nothing and every load of it is a load error (idempotent)."""
    worker.can_save = False
    refused = False
    for engine in worker_engines(worker):
        if not isinstance(engine.connector, WeightsReloadedConnector):
            engine.connector = WeightsReloadedConnector(engine.connector)
            refused = True
    if refused:
        logger.warning(
            "vLLM reloaded the model's weights in place: kvplug's chunks under this engine's keys hold the "
            "old weights' KV, so from now on this engine neither loads them (vLLM recomputes) nor stores "
            "(it would poison the keys of servers still on the old weights). Restart the server, or serve "
            "the new weights under a new model revision or cache_salt, to use the cache again."
        )
