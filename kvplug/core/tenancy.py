"""Pins and per-tenant quotas: what a tier knows of a key beyond its bytes.

- **Pins.** A pinned chunk is never an eviction victim of its tier. The engine keeps
  the wanted pins (:class:`PinBook`: config ``pin:`` prefixes, requests that ask for
  it, ``CacheEngine.pin``) and hands the book to every tier through
  :class:`~kvplug.TierContext`; a tier pins a wanted chunk when it stores it, and
  :meth:`kvplug.StorageTier.pin` pins chunks it holds already. Each tier's pinned bytes
  have their own budget (:class:`~kvplug.core.tenancy_settings.TenancySettings` ``pin_max_bytes``); a pin over it
  is refused, counted and logged, and the chunk stays an ordinary, evictable one.
  A tier whose store other processes share may keep a pin for all of them: a mark on the
  record itself that every process's evictions honour while the pinning process lives.
  Requests pin only where the operator lets them (:class:`~kvplug.core.tenants.TenancyConfig`
  ``request_pins``), each tenant within ``request_pin_max_bytes`` and its quota.
- **Tenants.** A tenant is a ``cache_salt``. Keys are ``<version>/<fingerprint>/<hash>``
  and the fingerprint digests the salt, so the salt cannot be read back from a key:
  the engine notes which fingerprint stands for which salt whenever it computes keys
  for a salted request (:class:`TenantBook`), and a tier asks the book about a key's
  fingerprint. Unsalted requests are no tenant: no quota applies to them. Figures name a
  tenant by the label :class:`~kvplug.core.tenants.TenantLabels` gives it, never by its salt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from kvplug.core.keys import ExtraKey, RequestInfo, StoreKey
from kvplug.core.tenancy_settings import MAX_PIN_PERCENT as MAX_PIN_PERCENT  # (defined here before)
from kvplug.core.tenancy_settings import MAX_SHARE_BYTES as MAX_SHARE_BYTES
from kvplug.core.tenancy_settings import TenancySettings as TenancySettings
from kvplug.core.tenancy_settings import parse_share as parse_share
from kvplug.core.tenancy_settings import share_bytes as share_bytes
from kvplug.core.tenants import DEFAULT_MAX_PINS, TenancyConfig, TenantLabels
from kvplug.core.tenants import OTHER_TENANTS as OTHER_TENANTS  # (defined here before: still importable)
from kvplug.core.tenants import UNSALTED as UNSALTED
from kvplug.core.throttled_log import ThrottledLog

_logger = logging.getLogger("kvplug.pins")


class PinSpec(BaseModel):
    """One configured pin: the chunks of a prefix (token ids in a file), for one salt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix_file: Path = Field(
        description="Token ids of the prefix to pin: a JSON list or whitespace-separated integers (as kvplug "
        "explain reads). A relative path is relative to the config file's folder."
    )
    salt: str | None = Field(default=None, description="The cache_salt of the requests the prefix serves.")
    lora_id: str | None = Field(default=None, description="The LoRA adapter of those requests, if any.")
    lora_path: str | None = Field(
        default=None,
        description="Where the engine loaded that adapter from: keyed by its files' content where "
        "kvplug can read them, else by the path, as the engine keys it (kvplug.ExtraKey.adapter_source).",
    )

    def request(self) -> RequestInfo:
        """The request identity the prefix is keyed under."""
        return RequestInfo(cache_salt=self.salt, lora_id=self.lora_id, extra_keys=ExtraKey.adapter_keys(self.lora_path))


#: The largest token file read (a configured pin's ``prefix_file``): past the token ids of any
#: context window; a bigger one (``/dev/zero``, a wrong file) is refused before it fills memory.
TOKEN_FILE_MAX_BYTES = 64 * 1024**2


def read_token_file(path: Path) -> list[int]:
    """Token ids from a file of at most :data:`TOKEN_FILE_MAX_BYTES`: a JSON list, or integers
    separated by whitespace or commas."""
    # Opened without waiting for a writer: a FIFO (or a device) named as the prefix is refused, where
    # a blocking open of a FIFO held the engine's start until some process wrote to it.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path}: not a regular file")
        data = file.read(TOKEN_FILE_MAX_BYTES + 1)  # at most one byte past the bound
    if len(data) > TOKEN_FILE_MAX_BYTES:
        raise ValueError(f"{path}: over {TOKEN_FILE_MAX_BYTES} bytes, longer than the token ids of any prompt")
    text = data.decode("utf-8").strip()
    body = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        tokens = [int(part) for part in body.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{path}: not a list of token ids (a JSON list or whitespace-separated integers)") from None
    # Chunk keys hash token ids as int64: a larger one raised OverflowError out of the engine's
    # start (a configured pin stopped it serving); the bounds are kvplug explain's and ctl's.
    bad = next((t for t in tokens if not 0 <= t < 2**63), None)
    if bad is not None:
        raise ValueError(f"{path}: token id {str(bad)[:40]} is not between 0 and 2**63 - 1")
    return tokens


def record_name(key: str) -> str:
    """The name record stores give ``key``: :func:`kvplug.key_digest` in hex (not imported
    from :mod:`kvplug.core.records.frame`, which needs the tier module that needs this one)."""
    return hashlib.sha256(key.encode()).hexdigest()


class PinBook:
    """The chunks an engine wants pinned, by key and by record name (the sha256 of the key,
    :func:`kvplug.key_digest`, which record stores see), and whether only requests want
    them (request pins count against their tenant's budgets, :class:`kvplug.GuardedEviction`).

    Thread-safe and bounded: it remembers at most ``max_keys`` keys (a remembered key is
    pinned by every tier that stores it later). Past that, a new pin takes the place of the
    oldest request pin (whose chunks stay pinned where tiers hold them: only a later store
    of them is not pinned), and when the book holds operator pins only, a new pin is
    refused (:meth:`add` returns the keys it did not remember: the caller says so)."""

    def __init__(self, max_keys: int = DEFAULT_MAX_PINS) -> None:
        self.max_keys = max_keys
        self._keys: dict[str, str] = {}  # key -> its record name
        self._names: dict[str, bool] = {}  # record name -> only requests want it
        self._requested: OrderedDict[str, None] = OrderedDict()  # keys only requests want, oldest first
        self._lock = threading.Lock()

    def add(self, keys: Iterable[str], *, requested: bool = False) -> list[str]:
        """Remember ``keys`` (``requested``: a request's pin); the keys not remembered
        because the book is full."""
        refused: list[str] = []
        with self._lock:
            for key in keys:
                name = self._keys.get(key)
                if name is not None:
                    if not requested and key in self._requested:  # the operator wants it too
                        del self._requested[key]
                        self._names[name] = False
                    continue
                if len(self._keys) >= self.max_keys:
                    if not self._requested:
                        refused.append(key)
                        continue
                    self._forget(next(iter(self._requested)))
                name = record_name(key)
                self._keys[key] = name
                self._names[name] = requested
                if requested:
                    self._requested[key] = None
        return refused

    def discard(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                if key in self._keys:
                    self._forget(key)

    def _forget(self, key: str) -> None:
        del self._names[self._keys.pop(key)]
        self._requested.pop(key, None)

    # Lookups of a dict are atomic under the GIL: no lock on these hot paths.
    def wants_key(self, key: str) -> bool:
        return key in self._keys

    def wants_name(self, name: str) -> bool:
        return name in self._names

    def requested_key(self, key: str) -> bool:
        """Whether only requests want ``key`` pinned."""
        return key in self._requested

    def requested_name(self, name: str) -> bool:
        """Whether only requests want the record ``name`` pinned."""
        return self._names.get(name, False)

    def __len__(self) -> int:
        return len(self._keys)


class TenantBook:
    """Which key fingerprint stands for which ``cache_salt`` (thread-safe, at most
    ``max_fingerprints``, the least recently noted forgotten first)."""

    def __init__(self, max_fingerprints: int = 65536) -> None:
        self.max_fingerprints = max_fingerprints
        self._salts: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, fingerprint_hex: str, salt: str | None) -> None:
        """Keys under ``fingerprint_hex`` belong to tenant ``salt`` (nothing for ``None``)."""
        if salt is None:
            return
        with self._lock:
            self._salts[fingerprint_hex] = salt
            self._salts.move_to_end(fingerprint_hex)
            while len(self._salts) > self.max_fingerprints:
                self._salts.popitem(last=False)

    def salts(self) -> set[str]:
        """The salts noted (those still remembered)."""
        with self._lock:
            return set(self._salts.values())

    def tenant_of(self, key: str) -> str | None:
        """The salt of a ``<version>/<fingerprint>/<hash>`` key, ``None`` when unsalted or unknown."""
        if not isinstance(key, str):  # (a bad key: the tier's own checks say so)
            return None
        fingerprint = StoreKey.fingerprint_of(key)
        return None if fingerprint is None else self._salts.get(fingerprint)


class NameTenants:
    """The tenants of record names (:func:`record_name`), for a store that sees names, not
    keys: a tier notes the keys it is asked about (:meth:`note`) before its store indexes
    their records. Thread-safe; at most ``max_names``, the least recently noted forgotten
    first (a forgotten record only counts as unsalted until it is noted again)."""

    def __init__(self, tenants: TenantBook, max_names: int = 65536) -> None:
        self._tenants = tenants
        self.max_names = max_names
        self._names: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def note(self, keys: Iterable[str]) -> None:
        found = [(record_name(key), tenant) for key in keys if (tenant := self._tenants.tenant_of(key)) is not None]
        if not found:
            return
        with self._lock:
            for name, tenant in found:
                self._names[name] = tenant
                self._names.move_to_end(name)
            while len(self._names) > self.max_names:
                self._names.popitem(last=False)

    def tenant_of(self, name: str) -> str | None:
        return self._names.get(name)


@dataclass
class Tenancy:
    """The pins and tenants of one engine, shared by its tiers (``TierContext.tenancy``)."""

    pins: PinBook = field(default_factory=PinBook)
    tenants: TenantBook = field(default_factory=TenantBook)
    #: How figures name tenants (never by their salt).
    labels: TenantLabels = field(default_factory=TenantLabels)
    _logs: dict[str, ThrottledLog] = field(default_factory=dict, repr=False)

    @classmethod
    def from_config(cls, config: TenancyConfig, label_key: bytes | None = None) -> Tenancy:
        """The tenancy of an engine configured with ``config`` (``tenancy:``)."""
        return cls(pins=PinBook(config.max_pins), labels=TenantLabels.from_config(config, label_key))

    def warn(self, kind: str, message: str, *args: object) -> None:
        """Log a refusal of ``kind`` at most once a minute (:class:`ThrottledLog`)."""
        log = self._logs.get(kind)
        if log is None:
            log = self._logs.setdefault(kind, ThrottledLog(_logger))
        log.warning(message, *args)


@dataclass(frozen=True)
class PinReport:
    """What :meth:`kvplug.CacheEngine.pin` or ``unpin`` did to a prompt's chunks.

    Each count is of the prompt's chunks (a whole chunk, or the partial one a store writes: its
    ``block_granular_hits`` tail, its last chunk with ``save_unfull_chunk``), each once however
    many records hold it (one per head group; another TP size's where ``pin`` pinned those,
    :func:`kvplug.core.engine.prompt_pins.pin_prompt`). ``chunks``: chunks now pinned (``pin``:
    each of its records in at least one tier) or no longer pinned (``unpin``); ``tokens``: the
    prompt's tokens those chunks cover; ``bytes``: of the records pinned (unpinned), summed over the tiers;
    ``refused``: chunks not pinned where asked: a tier refused them because its ``pin_max_bytes``
    (for a request's pin, its tenant's ``request_pin_max_bytes`` or quota) was spent, or no tier
    holds them and the pin book is full; ``missing``: chunks no tier that keeps pins holds yet
    (they are pinned when stored; ``unpin``: chunks nothing of which was pinned); ``book_full``:
    chunks the pin book could not remember (``tenancy.max_pins``): pinned only where held now,
    never when stored later. :func:`kvplug.pin_keys` counts each key a chunk."""

    chunks: int = 0
    bytes: int = 0
    refused: int = 0
    missing: int = 0
    book_full: int = 0
    tokens: int = 0


def anchor_pin_files(layer: dict[str, Any], folder: Path) -> dict[str, Any]:
    """A config file's layer with each relative ``pin[].prefix_file`` made relative to
    the file's ``folder`` (the layer itself, changed in place)."""
    pins = layer.get("pin")
    if isinstance(pins, list):
        for entry in pins:
            if isinstance(entry, dict) and isinstance(entry.get("prefix_file"), str):
                path = Path(entry["prefix_file"]).expanduser()
                entry["prefix_file"] = str(path if path.is_absolute() else folder / path)
    return layer
