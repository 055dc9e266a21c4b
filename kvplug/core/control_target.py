"""What ``kvplug ctl`` asks a running cache about: :class:`ControlTarget`.

A :class:`~kvplug.ControlServer` answers for one target: its tiers (a
:class:`~kvplug.TierChain`), its counters (:class:`~kvplug.EngineMetrics`), and how a
prompt maps to its keys. :class:`EngineControl` is the target of a
:class:`~kvplug.CacheEngine`; an adapter whose engine names its pages itself (a storage
backend under the engine's own cache) subclasses :class:`ControlTarget` and computes
the keys as its engine does. What a target cannot do (pins where no tier keeps them,
a salt the keys do not show) it refuses with a :class:`~kvplug.errors.ControlProtocolError`
naming why, which the operator reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvplug.core.control_protocol import ControlRequest, text_field
from kvplug.core.events import KVEvent
from kvplug.core.explain import explain_prompt
from kvplug.core.keys import RequestInfo
from kvplug.core.manifest import KeyScheme
from kvplug.core.metrics import EngineMetrics
from kvplug.core.tier_chain import TierChain
from kvplug.errors import ControlProtocolError

if TYPE_CHECKING:
    from kvplug.core.engine import CacheEngine
    from kvplug.core.tenancy import PinReport

#: Chunks a journal remembers at most (oldest forgotten first): bounds its memory.
MAX_JOURNAL_CHUNKS = 1 << 20


class ChunkJournal:
    """The keys a cache stored or loaded (from its events), newest last; bounded."""

    def __init__(self, max_chunks: int = MAX_JOURNAL_CHUNKS) -> None:
        self.max_chunks = max_chunks
        #: Keys dropped because the journal was full: ``clear`` cannot name them.
        self.forgotten = 0
        self._keys: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def on_event(self, event: KVEvent) -> None:
        if event.kind in ("stored", "loaded"):  # an eviction from one tier leaves the others: clear asks each
            self.add(event.keys)

    def add(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys[key] = None
                self._keys.move_to_end(key)
            while len(self._keys) > self.max_chunks:
                self._keys.popitem(last=False)
                self.forgotten += 1

    def keys(self, prefix: str = "") -> list[str]:
        with self._lock:
            return [key for key in self._keys if key.startswith(prefix)]

    def forget(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)


class ControlTarget:
    """One cache as ``kvplug ctl`` sees it; subclasses fill in what their keys need."""

    chain: TierChain
    metrics: EngineMetrics

    def __init__(self, chain: TierChain, metrics: EngineMetrics) -> None:
        self.chain = chain
        self.metrics = metrics
        self.journal = ChunkJournal()

    def describe(self) -> dict[str, Any]:
        """What ``kvplug ctl list`` shows besides the identity: model, fingerprint, chunk size."""
        return {}

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]]:
        """Per chunk of the cached prefix: (fastest tier holding it, its tokens)."""
        raise NotImplementedError

    def explain(self, tokens: Sequence[int], request: RequestInfo) -> dict[str, Any]:
        """A chunk map of the prompt over this cache's tiers (:meth:`Explanation.to_json`)."""
        raise ControlProtocolError("this engine cannot explain a prompt (its keys are not kvplug's chunk keys)")

    def pin(self, tokens: Sequence[int], request: RequestInfo, *, unpin: bool = False) -> PinReport:
        raise ControlProtocolError("this engine keeps no pins")

    def clear_keys(self, request: ControlRequest) -> tuple[list[str], str]:
        """The journal's keys a ``clear`` request means, and its scope in words."""
        if request.fields.get("all_salts") is True:
            return self.journal.keys(), "every cache_salt"
        raise ControlProtocolError("clear needs a scope this engine can tell: all_salts")

    def forget(self, keys: Sequence[str]) -> None:
        """``keys`` were cleared from every tier."""
        self.journal.forget(keys)

    def flush(self) -> None:
        """Let queued writes land (a clear then removes them too)."""
        self.chain.flush()

    def close(self) -> None:
        """Stop feeding the journal."""


class EngineControl(ControlTarget):
    """The control target of a :class:`~kvplug.CacheEngine`: its own lookups, explain over its
    tiers (the memory tier too), pins, and a journal fed by its events."""

    def __init__(self, engine: CacheEngine) -> None:
        super().__init__(engine.chain, engine.metrics)
        self.engine = engine
        engine.add_event_listener(self.journal.on_event)

    def describe(self) -> dict[str, Any]:
        fingerprint = self.engine.fingerprint
        return {
            "model": fingerprint.model_id,
            "fingerprint": fingerprint.hexdigest(),
            "chunk_size": self.engine.chunk_size,
        }

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]]:
        # The engine's own lookup (counted like any other), so that the answer is the one
        # its scheduler gets.
        return self.engine.lookup_tiers(tokens, request=request)

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
        )
        return found.to_json()

    def pin(self, tokens: Sequence[int], request: RequestInfo, *, unpin: bool = False) -> PinReport:
        return (self.engine.unpin if unpin else self.engine.pin)(tokens, request=request)

    def clear_keys(self, request: ControlRequest) -> tuple[list[str], str]:
        records = self.engine.records
        if request.fields.get("all_salts") is True:
            keys = self.journal.keys(f"{self.engine.fingerprint.format_version}/")
            return records.all_records(keys), "every cache_salt"
        if "cache_salt" not in request.fields:
            raise ControlProtocolError("clear needs a scope: cache_salt (null: no salt) or all_salts: true")
        info = request.request_info()
        fingerprint = self.engine.fingerprint.for_request(cache_salt=info.cache_salt, lora_id=info.lora_id)
        keys = records.all_records(self.journal.keys(fingerprint.key_prefix()))
        lora = f", LoRA {info.lora_id!r}" if info.lora_id else ""
        return keys, f"cache_salt {text_field(request.fields, 'cache_salt')!r}{lora}"

    def flush(self) -> None:
        self.engine.flush()

    def close(self) -> None:
        self.engine.remove_event_listener(self.journal.on_event)
