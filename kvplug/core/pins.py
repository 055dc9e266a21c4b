"""Pinning a prompt's chunks in every tier that keeps pins (``CacheEngine.pin``/``unpin``).

A pin is remembered in the chain's :class:`~kvplug.core.tenancy.PinBook`, so tiers pin
the chunks when they store them, and applied at once to the chunks tiers hold
(:meth:`kvplug.StorageTier.pin`). Pins live in this process: a restart re-applies
the config's ``pin:`` prefixes (:func:`apply_configured_pins`), not pins asked for later.

Pins come from the operator (config ``pin:``, ``kvplug ctl pin``, ``CacheEngine.pin``)
or from requests (``pin_request``), which any API client can set: those are honoured
only where ``tenancy.request_pins`` allows them (:func:`pin_for_request`), and each
tier holds them to their tenant's budgets.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.keys import RequestInfo
from kvplug.core.tenancy import PinReport, PinSpec, read_token_file

if TYPE_CHECKING:
    from kvplug.core.config.model import KVPlugConfig

logger = logging.getLogger("kvplug.pins")


def pin_keys(chain: TierChain, keys: Sequence[str], *, requested: bool = False) -> PinReport:
    """Pin ``keys`` now where tiers hold them, and when they are stored from now on.

    ``requested``: a request's pin, which tiers hold to its tenant's budgets; one the pin
    book cannot remember (it holds operator pins only) is not applied at all. An operator's
    pin the book cannot remember is applied where the chunks are held now. Either way the
    report counts them (``book_full``), ``kvplug_pin_book_full_total{origin}`` too, and the
    log says so."""
    return pin_keys_held(chain, keys, requested=requested)[0]


def pin_keys_held(chain: TierChain, keys: Sequence[str], *, requested: bool) -> tuple[PinReport, set[str]]:
    """:func:`pin_keys`, and the keys it did not count ``missing`` (held somewhere, or refused)."""
    tenancy = chain.tenancy
    unbooked = tenancy.pins.add(keys, requested=requested)
    if unbooked:
        origin = "request" if requested else "operator"
        chain.metrics.pin_book_full.labels(origin).inc(len(unbooked))
        tenancy.warn(
            "book_full",
            "pin book full (tenancy.max_pins: %d keys): %d chunks of a pin (%s) will not be pinned when stored",
            tenancy.pins.max_keys,
            len(unbooked),
            origin,
        )
    skipped = set(unbooked) if requested else set()
    asked = [key for key in keys if key not in skipped]
    pinned: set[str] = set()
    refused: set[str] = set(skipped)
    held: set[str] = set()
    nbytes = 0
    for tier in chain.tiers:
        outcomes = tier.pin(asked) if asked else []
        if outcomes is None:
            continue
        for key, (outcome, size) in zip(asked, outcomes):
            if outcome in ("pinned", "already"):
                pinned.add(key)
                nbytes += size
            elif outcome == "refused":
                refused.add(key)
            if outcome != "missing":
                held.add(key)
    # A chunk held nowhere that the book did not take will never be pinned: refused, not missing.
    refused.update(key for key in unbooked if key not in held)
    missing = sum(1 for key in keys if key not in held and key not in refused)
    report = PinReport(chunks=len(pinned), bytes=nbytes, refused=len(refused), missing=missing, book_full=len(unbooked))
    return report, held | refused


def unpin_keys(chain: TierChain, keys: Sequence[str]) -> PinReport:
    """Forget the pins of ``keys``; every tier makes them evictable again."""
    return unpin_keys_done(chain, keys)[0]


def unpin_keys_done(chain: TierChain, keys: Sequence[str]) -> tuple[PinReport, set[str]]:
    """:func:`unpin_keys`, and the keys some tier unpinned."""
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
    return PinReport(chunks=len(unpinned), bytes=nbytes, missing=len(keys) - len(unpinned)), unpinned


def pin_for_request(
    engine: Any, tokens: Sequence[int] | Any, request: RequestInfo | None, config: KVPlugConfig
) -> PinReport | None:
    """Pin the chunks a store of ``engine`` (a :class:`kvplug.CacheEngine`) keys for
    ``request``, which asked for it (``pin_request``; ``config``: the request's): ``None``,
    and counted (``kvplug_request_pins_ignored_total``) and logged, unless
    ``tenancy.request_pins``."""
    if not engine.config.tenancy.request_pins:
        engine.metrics.request_pins_ignored.inc()
        engine.chain.tenancy.warn(
            "request_pins_off",
            "a request asked to pin the chunks it stores (pin_request, e.g. kvplug.pin), but request pins are "
            "off (tenancy.request_pins: false): stored unpinned",
        )
        return None
    # the chunks the store writes: its tail too (block_granular_hits), or the tail would go first
    keys = engine.stored_keys(tokens, request, config)
    return pin_keys(engine.chain, engine.record_keys(keys, request), requested=True)


def apply_configured_pins(engine: Any, specs: Sequence[PinSpec]) -> None:
    """Pin each configured prefix (``pin:``) of ``engine`` (a :class:`kvplug.CacheEngine`):
    chunks held now are pinned, the others when they are stored. A file that cannot be
    read is logged and skipped: a pin is an optimisation, not a reason not to serve."""
    for spec in specs:
        try:
            tokens = read_token_file(Path(spec.prefix_file))
        except (OSError, ValueError) as exc:
            logger.error("pin: cannot read prefix_file %s: %s; that pin is not applied", spec.prefix_file, exc)
            continue
        report = engine.pin(tokens, request=spec.request())
        logger.info(
            "pin: %s%s: %d chunks pinned, %d refused, %d not stored yet",
            spec.prefix_file,
            "" if spec.salt is None else " (salted)",
            report.chunks,
            report.refused,
            report.missing,
        )
