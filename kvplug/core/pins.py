"""Pinning a prompt's chunks in every tier that keeps pins (``CacheEngine.pin``/``unpin``).

A pin is remembered in the chain's :class:`~kvplug.core.tenancy.PinBook`, so tiers pin
the chunks when they store them, and applied at once to the chunks tiers hold
(:meth:`kvplug.StorageTier.pin`). Pins live in this process: a restart re-applies
the config's ``pin:`` prefixes (:func:`apply_configured_pins`), not pins asked for later.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvplug.core.tenancy import PinReport, PinSpec, read_token_file
from kvplug.core.tier_chain import TierChain

logger = logging.getLogger("kvplug.pins")


def pin_keys(chain: TierChain, keys: Sequence[str]) -> PinReport:
    """Pin ``keys`` now where tiers hold them, and when they are stored from now on."""
    full = chain.tenancy.pins.add(keys)
    if full:
        logger.warning(
            "pin book full (%d keys): %d chunks pinned only where held now", chain.tenancy.pins.max_keys, full
        )
    pinned: set[str] = set()
    refused: set[str] = set()
    held: set[str] = set()
    nbytes = 0
    for tier in chain.tiers:
        outcomes = tier.pin(keys)
        if outcomes is None:
            continue
        for key, (outcome, size) in zip(keys, outcomes):
            if outcome in ("pinned", "already"):
                pinned.add(key)
                nbytes += size
            elif outcome == "refused":
                refused.add(key)
            if outcome != "missing":
                held.add(key)
    return PinReport(chunks=len(pinned), bytes=nbytes, refused=len(refused), missing=len(keys) - len(held))


def unpin_keys(chain: TierChain, keys: Sequence[str]) -> PinReport:
    """Forget the pins of ``keys``; every tier makes them evictable again."""
    chain.tenancy.pins.discard(keys)
    unpinned: set[str] = set()
    nbytes = 0
    for tier in chain.tiers:
        sizes = tier.unpin(keys)
        if sizes is None:
            continue
        for key, size in zip(keys, sizes):
            if size is not None:
                unpinned.add(key)
                nbytes += size
    return PinReport(chunks=len(unpinned), bytes=nbytes, missing=len(keys) - len(unpinned))


def apply_configured_pins(engine: Any, specs: Sequence[PinSpec]) -> None:
    """Pin each configured prefix (``pin:``) of ``engine`` (a :class:`kvplug.CacheEngine`):
    chunks held now are pinned, the others when they are stored. A file that cannot be
    read is logged and skipped: a pin is an optimisation, not a reason not to serve."""
    from kvplug.core.keys import RequestInfo

    for spec in specs:
        try:
            tokens = read_token_file(Path(spec.prefix_file))
        except (OSError, ValueError) as exc:
            logger.error("pin: cannot read prefix_file %s: %s; that pin is not applied", spec.prefix_file, exc)
            continue
        report = engine.pin(tokens, request=RequestInfo(cache_salt=spec.salt, lora_id=spec.lora_id))
        logger.info(
            "pin: %s (salt %r): %d chunks pinned, %d refused, %d not stored yet",
            spec.prefix_file,
            spec.salt,
            report.chunks,
            report.refused,
            report.missing,
        )
