"""SGLang plugin entry point (group ``sglang.srt.plugins``).

SGLang's ``load_plugins()`` calls :func:`register` in every process it starts
(launcher, engine, each scheduler / TP worker), possibly more than once per
process; ``SGLANG_PLUGINS=kvplug`` limits SGLang to this plugin. Registering
makes ``--radix-cache-backend kvplug`` available with no code.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvplug.sglang")


def register() -> None:
    """Register the radix-cache backend ``kvplug`` with SGLang (idempotent)."""
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from kvplug_sglang.at_exit import register_exit_hook
    from kvplug_sglang.radix_cache import BACKEND_NAME, kvplug_radix_cache_factory

    register_exit_hook()
    _record_downloads()
    _hear_weight_updates()
    existing = get_radix_cache_factory(BACKEND_NAME)
    if existing is kvplug_radix_cache_factory:
        return
    if existing is not None:
        # SGLang's registry refuses duplicates; someone else owns the name.
        logger.warning(
            "radix-cache backend %r is already registered by %r; kvplug left it alone", BACKEND_NAME, existing
        )
        return
    register_radix_cache_backend(BACKEND_NAME, kvplug_radix_cache_factory)


#: The function SGLang's model loader fetches a hub checkpoint with (its return: the snapshot folder).
DOWNLOAD = "sglang.srt.model_loader.weight_utils.download_weights_from_hf"
_recording = False


def _record_downloads() -> None:
    """Have SGLang tell kvplug the snapshot (commit) each hub checkpoint loads from: keys name
    the commit, not ``main`` (:func:`kvplug_sglang.page_identity.record_download`). SGLang
    applies registered hooks after its plugins ran, before it loads a model."""
    global _recording
    if _recording:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvplug_sglang.page_identity import record_download

    HookRegistry.register(DOWNLOAD, record_download, HookType.AFTER)
    _recording = True


#: The scheduler's in-place weight updates (its HTTP endpoints and ``Engine`` methods end there).
WEIGHT_UPDATES = tuple(
    f"sglang.srt.managers.scheduler_components.weight_updater.SchedulerWeightUpdaterManager.update_weights_from_{kind}"
    for kind in ("disk", "tensor", "distributed", "ipc")
)
_hearing = False


def _hear_weight_updates() -> None:
    """Have SGLang tell kvplug before each in-place weight update: keys then name the new
    weights (:func:`kvplug_sglang.page_identity.note_weight_update`). SGLang flushes its own
    prefix cache after one; kvplug's tiers keep the old weights' KV under the old keys."""
    global _hearing
    if _hearing:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvplug_sglang.page_identity import note_weight_update

    for target in WEIGHT_UPDATES:
        HookRegistry.register(target, note_weight_update, HookType.BEFORE)
    _hearing = True
