"""What ``kvplug ctl`` asks a running cache about: :class:`ControlTarget`.

A :class:`~kvplug.ControlServer` answers for one target: its tiers (a
:class:`~kvplug.TierChain`), its counters (:class:`~kvplug.core.metrics.EngineMetrics`), and how a
prompt maps to its keys. :class:`EngineControl` is the target of a
:class:`~kvplug.CacheEngine`; an adapter whose engine names its pages itself (a storage
backend under the engine's own cache) subclasses :class:`ControlTarget` and computes
the keys as its engine does. What a target cannot do (pins where no tier keeps them,
a salt the keys do not show) it refuses with a :class:`~kvplug.errors.ControlProtocolError`
naming why, which the operator reads.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from kvplug.core.chain.reads import leading
from kvplug.core.chain.removal import TierRemoval
from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.control.explain import explain_prompt
from kvplug.core.control.journal import ChunkJournal
from kvplug.core.control.protocol import ControlRequest, text_field
from kvplug.core.engine.locations import ChunkLocation
from kvplug.core.events import KVEvent
from kvplug.core.keys import RequestInfo
from kvplug.core.metrics import EngineMetrics
from kvplug.core.records.manifest import KeyScheme
from kvplug.core.tier import Medium
from kvplug.errors import ControlProtocolError

if TYPE_CHECKING:
    from kvplug.core.engine.cache_engine import CacheEngine
    from kvplug.core.tenancy import PinReport


@dataclass(frozen=True)
class ClearKeys:
    """The records a ``clear`` request means, whose they are, and its scope in words.

    ``written`` are records this engine stored; ``loaded`` are records it only loaded
    (another engine, or an earlier run, wrote them). From this engine's private tiers
    (``trusted_reads``: this process's own memory) ``clear`` removes both; from any other
    tier, which other engines may share, only the written records, and of those only the
    ones this engine's own writes put there (``written_to``, per tier index, when the
    target can tell): a tier that already held a record when this engine stored it kept
    the other writer's record, which stays.
    """

    written: list[str]
    loaded: list[str]
    scope: str
    #: Per tier (its index in the chain), the records of ``written`` this engine's writes
    #: put there; ``None``: not known, every written record counts as written everywhere.
    written_to: Mapping[int, Sequence[str]] | None = None

    def cancels(self) -> list[str]:
        """Every record the clear means: a queued write of one (this engine's own) is dropped."""
        return self.written + self.loaded

    def for_tier(self, index: int, *, private: bool) -> list[str]:
        """The records to remove from the tier at ``index`` (``private``: it has ``trusted_reads``)."""
        if private:
            return self.written + self.loaded
        if self.written_to is None:
            return list(self.written)
        return list(self.written_to.get(index, ()))


class ControlTarget:
    """One cache as ``kvplug ctl`` sees it; subclasses fill in what their keys need."""

    chain: TierChain
    metrics: EngineMetrics

    def __init__(self, chain: TierChain, metrics: EngineMetrics, *, hears_tiers: bool = False) -> None:
        """``hears_tiers``: the subclass feeds its tiers' events to ``journal.on_event``, so the
        journal keeps only keys some tier may hold (:class:`~kvplug.core.control.journal.ChunkJournal`)."""
        self.chain = chain
        self.metrics = metrics
        self.journal = ChunkJournal(in_flight=chain.writes_pending, hears_tiers=hears_tiers)

    def describe(self) -> dict[str, Any]:
        """What ``kvplug ctl list`` shows besides the identity: model, fingerprint, chunk size."""
        return {}

    @property
    def closed(self) -> bool:
        """Whether the cache is closed while its server still answers: it serves nothing, its figures are not live."""
        return False

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]]:
        """Per chunk of the cached prefix: (fastest tier holding it, its tokens)."""
        raise NotImplementedError

    def locate(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation]:
        """:meth:`lookup` with each chunk's medium and tier index: what a ``lookup`` request is
        answered with. :meth:`lookup` names tiers by type only, so this guesses the first of the
        chain's tiers of that type; a target that knows its chunks' keys overrides it with
        :meth:`locate_keys`, which tells two tiers of one type (two ``disk`` folders) apart."""
        first: dict[str, tuple[Medium, int]] = {}
        for index, tier in enumerate(self.chain.tiers):
            first.setdefault(tier.name, (tier.medium, index))
        return [
            ChunkLocation(first[name][0], name, n, tier_index=first[name][1])
            if name in first
            else ChunkLocation("remote", name, n)
            for name, n in self.lookup(tokens, request)
        ]

    def locate_keys(self, keys: Sequence[str], tokens_per_key: int) -> list[ChunkLocation]:
        """Where the chain holds each of the leading ``keys`` (the fastest tier, by its index in
        the chain), up to the first key no tier holds; each key holds ``tokens_per_key`` tokens."""
        if not keys:
            return []
        tiers = self.chain.tiers
        return [
            ChunkLocation(tiers[at].medium, tiers[at].name, tokens_per_key, tier_index=at)
            for at in leading(self.chain.locate_indices(keys))
        ]

    def explain(self, tokens: Sequence[int], request: RequestInfo) -> dict[str, Any]:
        """A chunk map of the prompt over this cache's tiers (:meth:`Explanation.to_json`)."""
        raise ControlProtocolError("this engine cannot explain a prompt (its keys are not kvplug's chunk keys)")

    def pin(self, tokens: Sequence[int], request: RequestInfo, *, unpin: bool = False) -> PinReport:
        raise ControlProtocolError("this engine keeps no pins")

    def clear_keys(self, request: ControlRequest) -> ClearKeys:
        """The journal's keys a ``clear`` request means (stored, only loaded), and its scope."""
        if request.fields.get("all_salts") is True:
            stored, loaded = self.journal.split()
            return ClearKeys(stored, loaded, "every cache_salt", self.journal.written_to(stored))
        raise ControlProtocolError("clear needs a scope this engine can tell: all_salts")

    def forget(self, keys: Sequence[str]) -> None:
        """``keys`` were cleared from every tier."""
        self.journal.forget(keys)

    def flush(self) -> None:
        """Let queued writes land."""
        self.chain.flush()

    def flush_stores(self) -> None:
        """Hand every store so far to the chain (a removal then cancels what is still queued)."""

    def remove(
        self, plan: Callable[[], ClearKeys], *, tiers: Collection[int] | None = None, count: bool = False
    ) -> tuple[ClearKeys, list[TierRemoval]]:
        """Remove the records ``plan()`` means from the tiers at ``tiers`` (None: all), through
        :meth:`TierChain.remove`: what ``kvplug ctl clear`` and an engine's cache reset do.

        Stores not yet handed to the chain are handed first, so the plan (read from the
        journal after them) names them, and the chain cancels their queued writes. Records
        removed from every tier are forgotten by the journal."""
        self.flush_stores()
        keys = plan()
        done = self.chain.remove(keys, tiers=tiers, count=count)
        if tiers is None:  # what may still be in a shared tier (another writer's) stays noted
            private = [tier.trusted_reads for tier in self.chain.tiers]
            gone = set(keys.written)
            for removal in done:
                gone.intersection_update(
                    keys.for_tier(removal.index, private=private[removal.index]) + removal.cancelled
                )
            self.forget([key for key in keys.written if key in gone])
        return keys, done

    def close(self) -> None:
        """Stop feeding the journal."""


class EngineControl(ControlTarget):
    """The control target of a :class:`~kvplug.CacheEngine`: its own lookups, explain over its
    tiers (the memory tier too), pins, and a journal fed by its events.

    The journal notes what the engine stored and loaded (its events) and which tiers its
    chain wrote each record to. ``companions`` are engines that store into the same tiers
    under fingerprints of their own (a model's other KV cache groups,
    ``CacheEngine(shares_tiers_with=engine)``): the journal notes theirs too, and ``clear``
    removes their records with the engine's."""

    def __init__(self, engine: CacheEngine, companions: Sequence[CacheEngine] = ()) -> None:
        super().__init__(engine.chain, engine.metrics, hears_tiers=True)
        self.engine = engine
        #: The engines whose stores and loads the journal notes: this one and its companions.
        self.engines = [engine, *companions]
        self.journal.in_flight = self._writes_in_flight
        for source in self.engines:
            if source.chain is not self.chain:
                raise ValueError("an engine's companions must store into its own tiers (shares_tiers_with)")
        # One listener per engine: a load names its chunks by record 0's key.
        self._listeners = [(source, partial(self._on_event, source)) for source in self.engines]
        for source, listener in self._listeners:
            source.add_event_listener(listener)
        self.chain.writes.add(self.journal.on_written)

    def _on_event(self, source: CacheEngine, event: KVEvent) -> None:
        if event.kind == "loaded" and source.records.count > 1:
            # Every record of a loaded chunk counts as loaded (their promotions' writes name them all),
            # so a clear of the private tiers names them even once record 0 is forgotten.
            event = replace(event, keys=tuple(source.records.all_records(event.keys)), token_counts=())
        self.journal.on_event(event)

    def _writes_in_flight(self, keys: Sequence[str]) -> list[bool]:
        """Whether a write of each key, by any of the engines, may still land in a tier."""
        found = [False] * len(keys)
        for source in self.engines:
            found = [a or b for a, b in zip(found, source.writes_in_flight(keys))]
        return found

    def describe(self) -> dict[str, Any]:
        fingerprint = self.engine.fingerprint
        return {
            "model": fingerprint.model_id,
            "fingerprint": fingerprint.hexdigest(),
            "chunk_size": self.engine.chunk_size,
        }

    @property
    def closed(self) -> bool:
        return any(source.closed for source in self.engines)

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]]:
        return [(location.tier, location.tokens) for location in self.locate(tokens, request)]

    def locate(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation]:
        # The engine's own lookup (counted like any other), so that the answer is the one
        # its scheduler gets, chunk hashes included.
        return self.engine.locate(tokens, request=request)

    def explain(self, tokens: Sequence[int], request: RequestInfo) -> dict[str, Any]:
        engine = self.engine
        fingerprint = engine.fingerprint.for_request(cache_salt=request.cache_salt, lora_id=request.lora_id)
        scheme = KeyScheme.of(fingerprint, engine.chunk_size, engine.config.hash)
        labels = [label for label, _ in engine.chain.stats()]
        found = explain_prompt(
            list(zip(labels, engine.chain.tiers)),
            scheme,
            tokens,
            extra_keys=request.extra_keys,
            save_unfull_chunk=engine.config.save_unfull_chunk,
            being_removed=engine.chain.being_removed,
        )
        return found.to_json()

    def pin(self, tokens: Sequence[int], request: RequestInfo, *, unpin: bool = False) -> PinReport:
        return (self.engine.unpin if unpin else self.engine.pin)(tokens, request=request)

    def clear_keys(self, request: ControlRequest) -> ClearKeys:
        for source in self.engines:  # a closed engine's tiers remove nothing: "cleared 0 chunks" would be said
            source._check_open()
        scoped: RequestInfo | None = None
        scope = "every cache_salt"
        if request.fields.get("all_salts") is not True:
            if "cache_salt" not in request.fields:
                raise ControlProtocolError("clear needs a scope: cache_salt (null: no salt) or all_salts: true")
            scoped = request.request_info()
            lora = f", LoRA {scoped.lora_id!r}" if scoped.lora_id else ""
            scope = f"cache_salt {text_field(request.fields, 'cache_salt')!r}{lora}"
        return self.planned_clear(scoped, scope)

    def planned_clear(self, scoped: RequestInfo | None = None, scope: str = "every cache_salt") -> ClearKeys:
        """The records of ``scoped``'s cache_salt and LoRA (``None``: of every salt) that this
        engine and its companions stored or loaded, as ``clear`` (or an engine's cache reset)
        removes them tier by tier (:meth:`ClearKeys.for_tier`)."""
        stored: list[str] = []
        loaded: list[str] = []
        for source in self.engines:
            if scoped is None:
                prefixes = [f"{source.fingerprint.format_version}/"]
            else:  # every record's: the journal forgets a record no tier holds while another may be held
                prefixes = source.records.record_prefixes(scoped)
            for prefix in prefixes:
                wrote, read = self.journal.split(prefix)
                # Every head group's record (what record 0's key names; other records' keys stay alone).
                stored += source.records.all_records(wrote)
                loaded += source.records.all_records(read)
        stored = list(dict.fromkeys(stored))  # once each: every salt's prefix is every engine's
        loaded = list(dict.fromkeys(loaded))
        return ClearKeys(stored, loaded, scope, self.journal.written_to(stored))

    def flush(self) -> None:
        for source in self.engines:
            source.flush()

    def flush_stores(self) -> None:
        for source in self.engines:
            source.flush_stores()

    def close(self) -> None:
        self.chain.writes.remove(self.journal.on_written)
        for source, listener in self._listeners:
            source.remove_event_listener(listener)
