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
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.keys import ChunkKey, RequestInfo
from kvplug.core.tenancy import PinReport, PinSpec, read_token_file

if TYPE_CHECKING:
    from kvplug.core.config.model import KVPlugConfig

logger = logging.getLogger("kvplug.pins")


def pin_keys(chain: TierChain, keys: Sequence[str], *, requested: bool = False, tokens_per_key: int = 0) -> PinReport:
    """Pin ``keys`` now where tiers hold them, and when they are stored from now on.

    Each key is a chunk of ``tokens_per_key`` tokens (an adapter's page) in the report.
    ``requested``: a request's pin, which tiers hold to its tenant's budgets; one the pin
    book cannot remember (it holds operator pins only) is not applied at all. An operator's
    pin the book cannot remember is applied where the chunks are held now. Either way the
    report counts them (``book_full``), ``kvplug_pin_book_full_total{origin}`` too, and the
    log says so."""
    return pin_record_keys(chain, keys, requested=requested).report(_pages(keys, tokens_per_key))


def unpin_keys(chain: TierChain, keys: Sequence[str], *, tokens_per_key: int = 0) -> PinReport:
    """Forget the pins of ``keys`` (chunks of ``tokens_per_key`` tokens); every tier makes them
    evictable again."""
    return unpin_record_keys(chain, keys).report(_pages(keys, tokens_per_key))


def _pages(keys: Sequence[str], size: int) -> list[PinnedChunk]:
    return [PinnedChunk(index * size, (index + 1) * size, [key]) for index, key in enumerate(keys)]


def pinned_chunks(keys: Sequence[ChunkKey], records: Sequence[str], count: int) -> list[PinnedChunk]:
    """The chunks ``keys`` as a pin reports them, with their ``count`` ``records`` each (chunk by chunk)."""
    return [PinnedChunk(key.start, key.end, records[i * count : (i + 1) * count]) for i, key in enumerate(keys)]


@dataclass(frozen=True)
class PinnedChunk:
    """A chunk of a prompt, tokens ``[start, end)``, as a pin reports it: whole where every one
    of ``records`` (its records in one split of the heads) is."""

    start: int
    end: int
    records: Sequence[str]


@dataclass
class KeyPins:
    """What a pin (or an unpin) did, record key by record key: ``done`` pinned (unpinned) in some
    tier, ``refused`` over a budget, ``held`` by some tier that keeps pins, ``unbooked`` not
    remembered by the pin book; ``bytes`` of ``done``, summed over the tiers."""

    unpin: bool
    done: set[str] = field(default_factory=set)
    refused: set[str] = field(default_factory=set)
    held: set[str] = field(default_factory=set)
    unbooked: set[str] = field(default_factory=set)
    bytes: int = 0

    def add(self, other: KeyPins) -> None:
        """Count ``other``'s keys too."""
        self.done |= other.done
        self.refused |= other.refused
        self.held |= other.held
        self.unbooked |= other.unbooked
        self.bytes += other.bytes

    def report(self, chunks: Sequence[PinnedChunk], also: Sequence[PinnedChunk] = ()) -> PinReport:
        """The :class:`PinReport` of ``chunks`` (and of ``also``, only those of it ``done``): a pin's
        chunk is pinned where all its records are, else refused where one is, else missing; an
        unpin's is unpinned where any of its records is, else missing (nothing of it was pinned)."""
        done: list[PinnedChunk] = []
        refused = missing = book_full = 0
        for chunk, optional in [*((c, False) for c in chunks), *((c, True) for c in also)]:
            records = chunk.records
            if all(key in self.done for key in records) or (self.unpin and any(key in self.done for key in records)):
                done.append(chunk)
            elif optional:
                continue
            elif any(key in self.refused for key in records):
                refused += 1
            elif any(key not in self.held for key in records):
                missing += 1
            book_full += any(key in self.unbooked for key in records)
        return PinReport(
            chunks=len(done),
            bytes=self.bytes,
            refused=refused,
            missing=missing,
            book_full=book_full,
            tokens=_covered(done),
        )


def _covered(chunks: Sequence[PinnedChunk]) -> int:
    """Tokens of the prompt that ``chunks`` cover, each once (a tail and a partial chunk overlap)."""
    total = end = 0
    for chunk in sorted(chunks, key=lambda c: c.start):
        if chunk.end > end:
            total += chunk.end - max(chunk.start, end)
            end = chunk.end
    return total


def pin_record_keys(chain: TierChain, keys: Sequence[str], *, requested: bool) -> KeyPins:
    """Pin record ``keys`` (:func:`pin_keys`): what it did to each."""
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
    # A chunk a load found unusable, its removal on its way, is held by no tier (a miss): pinned
    # only when stored again (the book has it), not counted pinned now.
    removing = chain.being_removed(keys) or [False] * len(keys)
    asked = [key for key, gone in zip(keys, removing) if key not in skipped and not gone]
    pins = KeyPins(unpin=False, refused=set(skipped), unbooked=set(unbooked))
    for tier in chain.tiers:
        outcomes = tier.pin(asked) if asked else []
        if outcomes is None:
            continue
        for key, (outcome, size) in zip(asked, outcomes):
            if outcome in ("pinned", "already"):
                pins.done.add(key)
                pins.bytes += size
            elif outcome == "refused":
                pins.refused.add(key)
            if outcome != "missing":
                pins.held.add(key)
    # A chunk held nowhere that the book did not take will never be pinned: refused, not missing.
    pins.refused.update(key for key in unbooked if key not in pins.held)
    return pins


def unpin_record_keys(chain: TierChain, keys: Sequence[str]) -> KeyPins:
    """Forget the pins of record ``keys`` (:func:`unpin_keys`): which some tier unpinned."""
    chain.tenancy.pins.discard(keys)
    pins = KeyPins(unpin=True)
    for tier in chain.tiers:
        sizes = tier.unpin(keys)
        if sizes is None:
            continue
        for key, size in zip(keys, sizes):
            if size is not None:
                pins.done.add(key)
                pins.bytes += size
    return pins


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
    own = engine.record_keys(keys, request)
    pins = pin_record_keys(engine.chain, own, requested=True)
    return pins.report(pinned_chunks(keys, own, engine.records.count))


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
