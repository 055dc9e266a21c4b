"""Chunk keys: chained, stable hashes of token ids under a compatibility fingerprint.

``hash_i = H(hash_{i-1} || token ids of chunk i || extra keys of chunk i)``, so a
chunk's key names its whole prefix. ``H`` is sha256 (default), xxh3_128 or blake3;
never Python's ``hash()``, so every process and machine computes the same keys.

A key is ``<format version>/<fingerprint hex>/<chunk hash hex>``: hex only, safe as a
file or object name whatever the user sent.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from array import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, Protocol

import blake3
import xxhash

from kvplug.core.adapter_digest import ADAPTER_DIGESTS
from kvplug.core.chunk_format import dtype_name
from kvplug.errors import KeyFormatError

#: Bump when the meaning of stored bytes changes; old chunks then never match.
KV_FORMAT_VERSION = "v1"

HashName = Literal["sha256", "xxh3_128", "blake3"]


class _Digest(Protocol):
    def update(self, data: bytes | memoryview, /) -> object: ...
    def digest(self) -> bytes: ...


HASHES: dict[str, Callable[[], _Digest]] = {
    "sha256": hashlib.sha256,
    "xxh3_128": xxhash.xxh3_128,
    "blake3": blake3.blake3,
}


@dataclass(frozen=True)
class Fingerprint:
    """Everything that makes stored KV bytes incompatible with, or private from, others.

    Two requests share chunks only when every field is equal. ``cache_salt`` and
    ``lora_id`` are per request: use :meth:`for_request`.
    """

    model_id: str
    kv_layout: str
    dtype: str
    block_size: int
    model_revision: str = ""
    #: Engine-side choices that change the bytes of a layout with the same shape: the
    #: KV cache dtype as the engine spells it, an attention kernel's packing (a CPU
    #: backend that packs blocks per instruction set). Empty when there are none.
    engine_variant: str = ""
    format_version: str = KV_FORMAT_VERSION
    serializer: str = "raw"
    #: The model's KV heads a record holds, ``"<first>-<end>/<total>"`` (see
    #: :mod:`kvplug.core.engine.head_shards`): keys independent of the writer's TP size. Empty
    #: for adapters that key records per rank with ``tp_rank``/``tp_size`` instead.
    kv_heads: str = ""
    #: Per-rank keys (adapters whose records are not split by head range); adapters
    #: that set ``kv_heads`` leave these at 0/1, so any TP size reads their records.
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    lora_id: str | None = None
    cache_salt: str | None = None

    @classmethod
    def for_layout(cls, layout: Any, *, model_id: str, **fields: Any) -> Fingerprint:
        """A fingerprint for a :class:`kvplug.KVLayout` (layout, dtype, block size)."""
        return cls(
            model_id=model_id,
            kv_layout=layout.describe(),
            dtype=dtype_name(layout.dtype),
            block_size=layout.block_size,
            **fields,
        )

    def for_request(self, *, cache_salt: str | None = None, lora_id: str | None = None) -> Fingerprint:
        """This fingerprint for one request's tenant (``cache_salt``) and LoRA adapter."""
        return replace(self, cache_salt=cache_salt, lora_id=lora_id)

    def hexdigest(self) -> str:
        """32 hex chars of sha256 over the fields as canonical JSON."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def key_prefix(self) -> str:
        """``<format version>/<fingerprint hex>/``: what the keys of chunks stored under this
        fingerprint start with (the chunk's chained hash in hex follows)."""
        return f"{self.format_version}/{self.hexdigest()}/"


_HEX = frozenset("0123456789abcdef")
#: A fingerprint's hex digest (:meth:`Fingerprint.hexdigest`) is this long.
FINGERPRINT_HEX_CHARS = 32
#: A chunk digest in hex: 16 bytes (xxh3_128) up to 64 (room for longer hashes).
DIGEST_HEX_CHARS = range(32, 129)
# The shapes checked on every key (one match each); the checks that name a wrong part
# run only once a match has failed.
_VERSION = re.compile(r"v[0-9]+")
_FINGERPRINT = re.compile(r"[0-9a-f]{32}")
_DIGEST = re.compile(r"[0-9a-f]{32,128}")
_KEY = re.compile(r"(v[0-9]+)/([0-9a-f]{32})/([0-9a-f]{32,128})")


def _check_hex(part: str, name: str, lengths: range, text: str) -> None:
    if len(part) not in lengths:
        wanted = str(lengths.start) if len(lengths) == 1 else f"{lengths.start} to {lengths.stop - 1}"
        raise KeyFormatError(f"store key {text!r}: its {name} has {len(part)} characters, not {wanted}")
    if not _HEX.issuperset(part):
        raise KeyFormatError(f"store key {text!r}: its {name} is not lowercase hex")


@dataclass(frozen=True, slots=True)
class KeyPrefix:
    """``<format version>/<fingerprint hex>/``: the part of a store key that names the
    fingerprint its chunks are stored under (:meth:`Fingerprint.key_prefix`)."""

    version: str
    fingerprint: str

    def __post_init__(self) -> None:
        if _VERSION.fullmatch(self.version) is None:
            raise KeyFormatError(f"store key {str(self)!r}: its format version {self.version!r} is not v<number>")
        if _FINGERPRINT.fullmatch(self.fingerprint) is None:
            _check_hex(
                self.fingerprint, "fingerprint", range(FINGERPRINT_HEX_CHARS, FINGERPRINT_HEX_CHARS + 1), str(self)
            )

    @classmethod
    def parse(cls, text: str) -> KeyPrefix:
        """The prefix ``text`` spells (with or without its closing ``/``); a
        :class:`~kvplug.errors.KeyFormatError` naming what is wrong otherwise."""
        parts = text.removesuffix("/").split("/")
        if len(parts) != 2:
            raise KeyFormatError(f"store key prefix {text!r}: {len(parts)} parts, not 2 (<version>/<fingerprint>/)")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.version}/{self.fingerprint}/"


@dataclass(frozen=True, slots=True)
class StoreKey:
    """A chunk's key in the tiers, parsed and checked once: ``<version>/<fingerprint>/<digest>``,
    hex only. It becomes a string (``str(key)``) where it is handed to a
    :class:`~kvplug.StorageTier`; parts are read from here, never split out of the string."""

    prefix: KeyPrefix
    digest: str

    def __post_init__(self) -> None:
        if _DIGEST.fullmatch(self.digest) is None:
            _check_hex(self.digest, "digest", DIGEST_HEX_CHARS, f"{self.prefix}{self.digest}")

    @classmethod
    def parse(cls, text: str) -> StoreKey:
        """The key ``text`` spells; a :class:`~kvplug.errors.KeyFormatError` naming what is
        wrong otherwise (parts, version, lengths, characters)."""
        match = _KEY.fullmatch(text)
        if match is not None:
            version, fingerprint, digest = match.groups()
        else:
            parts = text.split("/")
            if len(parts) != 3:
                raise KeyFormatError(
                    f"store key {text!r}: {len(parts)} parts, not 3 (<version>/<fingerprint>/<digest>)"
                )
            version, fingerprint, digest = parts
        return cls(KeyPrefix(version, fingerprint), digest)

    @staticmethod
    def fingerprint_of(text: str) -> str | None:
        """The fingerprint part of ``text`` if it is a well-formed key, else ``None``: for a
        path that asks of every key a tier is given (tenancy), without building a value."""
        match = _KEY.fullmatch(text)
        return None if match is None else match.group(2)

    @property
    def fingerprint(self) -> str:
        return self.prefix.fingerprint

    def short(self, chars: int = 12) -> str:
        """The digest's first ``chars`` characters: how a table names a chunk."""
        return self.digest[:chars]

    def under(self, prefix: KeyPrefix) -> StoreKey:
        """The same chunk under another fingerprint (another head group's record)."""
        return StoreKey(prefix, self.digest)

    def __str__(self) -> str:
        return f"{self.prefix}{self.digest}"


@dataclass(frozen=True)
class ExtraKey:
    """A key mixed into every chunk that overlaps tokens ``[start, end)``.

    Multimodal inputs use the hash of the image/audio at its placeholder tokens;
    anything else that changes the KV of specific tokens can too.
    """

    start: int
    end: int
    value: str

    @classmethod
    def adapter_source(cls, source: str) -> ExtraKey:
        """The key of a LoRA adapter's weights, by where they were loaded from: an adapter
        re-pointed at other weights under one name (:attr:`RequestInfo.lora_id`) must not
        share chunks with the old ones. A local file or folder kvplug can read is keyed by
        its files' names and bytes (:mod:`kvplug.core.adapter_digest`): rewritten at its path
        it is another key, copied elsewhere the same; anything else (a hub id, a URI, an
        unreadable path) by the source string. It covers the first token only: the chained
        hash carries it into every later chunk."""
        content = ADAPTER_DIGESTS.digest(source)
        if content is not None:
            return cls(0, 1, "adapter_content:" + content)
        return cls(0, 1, "adapter_source:" + hashlib.sha256(source.encode()).hexdigest())

    @classmethod
    def adapter_keys(cls, source: str | None) -> tuple[ExtraKey, ...]:
        """The extra keys of a request's LoRA adapter loaded from ``source``: its
        :meth:`adapter_source` key, or none where no source is known (``None`` or empty)."""
        return (cls.adapter_source(source),) if source else ()


@dataclass(frozen=True)
class RequestInfo:
    """What one request adds to the shared config: isolation, extra keys, overrides."""

    cache_salt: str | None = None
    lora_id: str | None = None
    extra_keys: tuple[ExtraKey, ...] = ()
    #: Config settings for this request only (``KVPlugConfig.with_overrides``).
    overrides: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ChunkKey:
    """The key of tokens ``[start, end)``, the ``index``-th chunk of a prompt."""

    index: int
    start: int
    end: int
    key: str

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class KeyBuilder:
    """Cuts token ids into chunks and names each one by its chained hash."""

    chunk_size: int = 256
    hash_name: HashName = "sha256"
    _new_digest: Callable[[], _Digest] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {self.chunk_size}")
        try:
            object.__setattr__(self, "_new_digest", HASHES[self.hash_name])
        except KeyError:
            raise ValueError(f"hash {self.hash_name!r} is not one of {', '.join(HASHES)}") from None

    def chunk_bounds(self, num_tokens: int, *, include_partial: bool) -> list[tuple[int, int]]:
        full = num_tokens // self.chunk_size
        bounds = [(i * self.chunk_size, (i + 1) * self.chunk_size) for i in range(full)]
        if include_partial and num_tokens % self.chunk_size:
            bounds.append((full * self.chunk_size, num_tokens))
        return bounds

    def keys(
        self,
        tokens: Sequence[int] | Any,
        fingerprint: Fingerprint | str,
        *,
        extra_keys: Sequence[ExtraKey] = (),
        include_partial: bool = False,
    ) -> list[ChunkKey]:
        """Keys of the prompt's chunks; the partial last chunk only if asked.

        ``fingerprint`` may also be the key prefix itself, ``<format version>/<fingerprint
        hex>/`` (what a store's fingerprint manifest records, see :mod:`kvplug.core.records.manifest`)."""
        token_bytes = _token_bytes(tokens)
        prefix = fingerprint if isinstance(fingerprint, str) else fingerprint.key_prefix()
        previous = self.chain_seed()
        keys: list[ChunkKey] = []
        for index, (start, end) in enumerate(self.chunk_bounds(len(token_bytes) // 8, include_partial=include_partial)):
            previous = self._chunk_digest(previous, token_bytes, start, end, extra_keys)
            keys.append(ChunkKey(index, start, end, prefix + previous.hex()))
        return keys

    def keys_from_hashes(
        self,
        tokens: Sequence[int] | Any,
        prefix: str,
        hashes: Sequence[str],
        *,
        extra_keys: Sequence[ExtraKey] = (),
        include_partial: bool = False,
    ) -> list[ChunkKey] | None:
        """:meth:`keys` from the chained hashes (hex) a lookup found, one per chunk, without
        hashing the chunks before the last again; ``None`` when the counts differ. The last
        chunk is hashed: a lookup's last hash can be a shorter cut of it (a stored tail,
        ``block_granular_hits``), partial or whole, and that record read as this chunk would
        fail its shape check and be removed."""
        bounds = self.chunk_bounds(len(tokens), include_partial=include_partial)
        if len(bounds) != len(hashes):
            return None
        keys = [ChunkKey(i, start, end, prefix + h) for i, ((start, end), h) in enumerate(zip(bounds, hashes))]
        if keys:
            after = keys[-2] if len(keys) > 1 else None
            keys[-1:] = self.tail_keys(tokens, prefix, after, [keys[-1].num_tokens], extra_keys=extra_keys)
        return keys

    def tail_keys(
        self,
        tokens: Sequence[int] | Any,
        prefix: str,
        after: ChunkKey | None,
        lengths: Sequence[int],
        *,
        extra_keys: Sequence[ExtraKey] = (),
    ) -> list[ChunkKey]:
        """The keys of the chunk following ``after`` (``None``: the first chunk) as the partial
        last chunk of ``tokens[:start + n]`` for each ``n`` of ``lengths``: what :meth:`keys`
        with ``include_partial`` names it, without hashing the prefix again. ``prefix``: the
        key prefix, ``<format version>/<fingerprint hex>/``."""
        token_bytes = _token_bytes(tokens)
        index, start = (0, 0) if after is None else (after.index + 1, after.end)
        previous = self.chain_seed() if after is None else bytes.fromhex(after.key.rpartition("/")[2])
        return [
            ChunkKey(
                index,
                start,
                start + n,
                prefix + self._chunk_digest(previous, token_bytes, start, start + n, extra_keys).hex(),
            )
            for n in lengths
        ]

    def _chunk_digest(
        self, previous: bytes, token_bytes: memoryview, start: int, end: int, extra_keys: Sequence[ExtraKey]
    ) -> bytes:
        digest = self._new_digest()
        digest.update(previous)
        digest.update(struct.pack("<I", end - start))
        digest.update(token_bytes[start * 8 : end * 8])
        for extra in extra_keys:
            if extra.start < end and extra.end > start:
                encoded = extra.value.encode()
                digest.update(struct.pack("<qqI", extra.start, extra.end, len(encoded)))
                digest.update(encoded)
        return digest.digest()

    def chain_seed(self) -> bytes:
        return f"kvplug-chain/{self.hash_name}".encode()


def _token_bytes(tokens: Sequence[int] | Any) -> memoryview:
    """Token ids as little-endian int64 bytes, whatever container they came in."""
    if hasattr(tokens, "tolist"):  # torch tensors and numpy arrays
        tokens = tokens.tolist()
    packed = array("q", tokens)
    if packed.itemsize != 8:  # pragma: no cover - every supported platform has 8-byte q
        raise RuntimeError("array('q') is not 64-bit on this platform")
    if struct.pack("=q", 1) != struct.pack("<q", 1):  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return memoryview(packed).cast("B")
