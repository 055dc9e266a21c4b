"""Opening the configured tiers of a :class:`~kvplug.TierChain` (``config.tiers``, resolved):
each gets its :class:`~kvplug.TierContext` (whose ``emit`` stamps the tier's position on its
events); one that fails closes the ones already open."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
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
                emit=_stamped(emit or registry.emit, index),
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


def _stamped(emit: Callable[[KVEvent], None], index: int) -> Callable[[KVEvent], None]:
    """``emit`` for the tier at ``index``: its events carry that position (``KVEvent.tier_index``),
    which tells two tiers of one type apart, without the tier having to know it."""

    def stamped(event: KVEvent) -> None:
        emit(event if event.tier is None else replace(event, tier_index=index))

    return stamped


def preflight_tiers(specs: Sequence[Any], registry: PluginRegistry) -> None:
    """Run every configured tier's :meth:`StorageTier.preflight` (no side effects); the
    first failure is a :class:`~kvplug.errors.TierOpenError` naming its entry."""
    for index, spec in enumerate(specs):
        try:
            registry.storage_tiers()[spec.type].preflight(spec.options)
        except Exception as exc:
            raise TierOpenError(index, spec.type, exc) from None
