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
