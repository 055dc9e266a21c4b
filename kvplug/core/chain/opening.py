"""Opening the configured tiers of a :class:`~kvplug.TierChain` (``config.tiers``, resolved):
each gets its :class:`~kvplug.TierContext`; one that fails closes the ones already open."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from kvplug.core.events import KVEvent
from kvplug.core.metrics import EngineMetrics
from kvplug.core.plugins import PluginRegistry
from kvplug.core.tenancy import Tenancy
from kvplug.core.tier import StorageTier, TierContext
from kvplug.errors import TierOpenError


def open_tiers(
    specs: Sequence[Any],
    registry: PluginRegistry,
    *,
    fingerprint: str | None,
    metrics: EngineMetrics,
    emit: Callable[[KVEvent], None] | None,
    tenancy: Tenancy,
    read_only: bool,
    max_record_bytes: int | None,
) -> list[StorageTier]:
    """The tiers ``specs`` name, fastest first (see :meth:`TierChain.open`)."""
    tiers: list[StorageTier] = []
    try:
        for index, spec in enumerate(specs):
            context = TierContext(
                tier_index=index,
                fingerprint=fingerprint,
                logger=logging.getLogger(f"kvplug.tier.{spec.type}"),
                emit=emit or registry.emit,
                metrics=metrics,
                tenancy=tenancy,
                read_only=read_only,
                max_record_bytes=max_record_bytes,
            )
            tier_class = registry.storage_tiers()[spec.type]
            try:
                tiers.append(tier_class(spec.options, context))
            except Exception as exc:
                # One line naming the entry; the tier's traceback (whose text may hold
                # an unredacted URL) only at debug level.
                context.logger.debug("tiers[%d] (type %s) failed to open", index, spec.type, exc_info=True)
                raise TierOpenError(index, spec.type, exc) from None
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return tiers


def preflight_tiers(specs: Sequence[Any], registry: PluginRegistry) -> None:
    """Run every configured tier's :meth:`StorageTier.preflight` (no side effects); the
    first failure is a :class:`~kvplug.errors.TierOpenError` naming its entry."""
    for index, spec in enumerate(specs):
        try:
            registry.storage_tiers()[spec.type].preflight(spec.options)
        except Exception as exc:
            raise TierOpenError(index, spec.type, exc) from None
