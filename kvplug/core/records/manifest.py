"""Fingerprint manifests: what a store's keys were written under, readable from the store.

A chunk key (``<format version>/<fingerprint hex>/<chunk hash hex>``) names a digest of
the fingerprint, not its fields, and persistent tiers name records by a digest of the
key: a store alone cannot say why a second engine never hits. So an engine writes, once
per fingerprint it stores under (its own, and each ``cache_salt``/LoRA variant of it),
one small record into every tier it opens: its *manifest*.

- Key: ``<format version>/<fingerprint hex>/<64 hex>``, the last part
  ``sha256("kvplug-manifest/<hash>/<chunk size>")``: a name of the same shape as every
  chunk key, computable from a key scheme (fingerprint, chunk size, hash), so a tier
  that cannot list (mooncake) still answers ``contains`` for it.
- Value: ``MANIFEST_MAGIC`` then canonical JSON (never pickle) of the fingerprint's
  fields, the chunk size and the hash, at most ``MANIFEST_MAX_BYTES``. ``cache_salt``
  is kept only as an unkeyed digest (``sha256:<16 hex>``): a reader of the store learns
  whether two salts are equal and can test a guessed salt (as against a key's fingerprint
  digest), but does not read it.

``kvplug explain`` lists the manifests of tiers that can list (``kvplug.RecordStore``:
disk, s3, valkey), and checks which fingerprints hold a prompt's chunks.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvplug.core.chain.tier_chain import TierChain
from kvplug.core.chain.write_queue import Items
from kvplug.core.keys import Fingerprint, KeyBuilder, KeyPrefix, RequestInfo
from kvplug.core.tier import Buffer

#: First bytes of a manifest value (a chunk frame starts with another magic).
MANIFEST_MAGIC = b"kvplug-manifest/1\n"
#: A manifest is never larger: a listing reads only records this small to find them.
MANIFEST_MAX_BYTES = 16 * 1024
#: An engine writes a manifest again after this long, so an LRU tier keeps it.
MANIFEST_REFRESH_S = 600.0
#: How many fingerprints an engine remembers having written (salts are per request).
MANIFEST_MEMORY = 4096
#: The key prefix a manifest records: ``<format version>/<fingerprint hex digest>/``.
_PREFIX = re.compile(r"[A-Za-z0-9._-]{1,16}/[0-9a-f]{32}/")

#: The fields a manifest records, in the order a person compares them, and their names.
FIELD_NAMES: dict[str, str] = {
    "model_id": "model",
    "model_revision": "model revision",
    "dtype": "dtype",
    "block_size": "block size",
    "kv_layout": "KV layout",
    "engine_variant": "engine variant (KV cache dtype, attention ISA, KV cache group)",
    "kv_heads": "KV heads (range of the model's, by record)",
    "tp_rank": "TP rank",
    "tp_size": "TP size",
    "pp_rank": "PP rank",
    "pp_size": "PP size",
    "serializer": "serializer",
    "lora_id": "LoRA",
    "cache_salt": "cache_salt",
    "format_version": "KV format version",
    "chunk_size": "chunk size",
    "hash": "hash",
}

Fields = dict[str, str | int | None]


def salt_digest(salt: str | None) -> str | None:
    """What a manifest keeps of a ``cache_salt``: equal salts give equal digests."""
    if salt is None:
        return None
    return "sha256:" + hashlib.sha256(b"kvplug-salt/" + salt.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class KeyScheme:
    """What names a prompt's chunks: the key prefix (format version and fingerprint
    digest), the chunk size and the hash, with the fingerprint's fields (``cache_salt``
    as its digest) for comparing schemes."""

    prefix: str
    chunk_size: int
    hash_name: str
    fields: Fields

    @classmethod
    def of(cls, fingerprint: Fingerprint, chunk_size: int, hash_name: str) -> KeyScheme:
        fields: Fields = {k: v for k, v in asdict(fingerprint).items() if k != "cache_salt"}
        fields["cache_salt"] = salt_digest(fingerprint.cache_salt)
        fields.update(chunk_size=chunk_size, hash=hash_name)
        return cls(fingerprint.key_prefix(), chunk_size, hash_name, fields)

    @property
    def fingerprint_hex(self) -> str:
        return KeyPrefix.parse(self.prefix).fingerprint

    def key_builder(self) -> KeyBuilder:
        return KeyBuilder(self.chunk_size, self.hash_name)  # type: ignore[arg-type]

    def manifest_key(self) -> str:
        name = f"kvplug-manifest/{self.hash_name}/{self.chunk_size}".encode()
        return self.prefix + hashlib.sha256(name).hexdigest()

    def differences(self, other: KeyScheme) -> list[str]:
        """The fields (as :data:`FIELD_NAMES` names them) whose values differ."""
        keys = [k for k in FIELD_NAMES if k in self.fields or k in other.fields]
        return [FIELD_NAMES[k] for k in keys if self.fields.get(k) != other.fields.get(k)]


def encode_manifest(scheme: KeyScheme) -> bytes:
    body = {"fields": scheme.fields, "prefix": scheme.prefix}
    data = MANIFEST_MAGIC + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    if len(data) > MANIFEST_MAX_BYTES:  # a model id of kilobytes: the manifest is not written
        raise ValueError(f"a manifest of {len(data)} bytes is over {MANIFEST_MAX_BYTES}")
    return data


def decode_manifest(value: Buffer) -> KeyScheme | None:
    """The scheme a manifest value records; ``None`` for any value that is not one
    (a chunk frame, a manifest of a later format, one that does not parse)."""
    view = memoryview(value)
    if view.nbytes > MANIFEST_MAX_BYTES or bytes(view[: len(MANIFEST_MAGIC)]) != MANIFEST_MAGIC:
        return None
    try:
        body: Any = json.loads(bytes(view[len(MANIFEST_MAGIC) :]))
        fields, prefix = body["fields"], body["prefix"]
        ok = isinstance(fields, dict) and isinstance(prefix, str) and _PREFIX.fullmatch(prefix) is not None
        ok = ok and all(isinstance(v, (str, int)) or v is None for v in fields.values())
        if not ok or not isinstance(fields.get("chunk_size"), int) or not isinstance(fields.get("hash"), str):
            return None
        KeyBuilder(fields["chunk_size"], fields["hash"])  # a chunk size or hash this kvplug cannot use
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested too deep
        return None
    return KeyScheme(prefix, fields["chunk_size"], fields["hash"], fields)


class ManifestWriter:
    """Writes an engine's manifests into every tier of its chain, whatever a tier's
    admission policy (``explain`` reads them there): :meth:`note` writes the manifest of a
    fingerprint not written in the last :data:`MANIFEST_REFRESH_S` seconds. Bounded
    memory: the oldest of :data:`MANIFEST_MEMORY` fingerprints are forgotten, and written
    again when seen again."""

    def __init__(
        self,
        chain: TierChain,
        chunk_size: int,
        hash_name: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._chain, self._chunk_size, self._hash_name = chain, chunk_size, hash_name
        self._written: OrderedDict[str, float] = OrderedDict()
        self._clock = clock
        self._lock = threading.Lock()

    def note(self, fingerprint: Fingerprint, request: RequestInfo | None = None) -> None:
        """Chunks are stored under ``fingerprint`` (for ``request``: its salt and LoRA):
        write that fingerprint's manifest when due, on this thread."""
        self.write(self.due(fingerprint, request))

    def due(self, fingerprint: Fingerprint, request: RequestInfo | None = None) -> Items:
        """The manifest :meth:`note` would write now (none when not due), counted as written:
        for a caller that hands it to :meth:`write` on another thread, or to :meth:`forget`."""
        if request is not None:
            fingerprint = fingerprint.for_request(cache_salt=request.cache_salt, lora_id=request.lora_id)
        scheme = KeyScheme.of(fingerprint, self._chunk_size, self._hash_name)
        key = scheme.manifest_key()
        with self._lock:
            now = self._clock()
            last = self._written.get(key)
            if last is not None and now - last < MANIFEST_REFRESH_S:
                return []
            self._written[key] = now
            self._written.move_to_end(key)
            while len(self._written) > MANIFEST_MEMORY:
                self._written.popitem(last=False)
        try:
            value = encode_manifest(scheme)
        except ValueError:  # a model id of kilobytes: no manifest, explain cannot name it
            return []
        return [(key, value)]

    def write(self, items: Items) -> None:
        """Write manifests from :meth:`due` into every tier, whatever its admission policy."""
        if items:
            self._chain.put(items, admission=False)

    def forget(self, items: Items) -> None:
        """Manifests from :meth:`due` that were never written (their store was dropped): due again."""
        with self._lock:
            for key, _ in items:
                self._written.pop(key, None)
