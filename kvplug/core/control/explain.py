"""Why a prompt hits where it does: a chunk map of a prompt over a chain's tiers.

:func:`explain_prompt` computes a prompt's chunk keys as an engine does (its fingerprint,
chunk size and hash: a :class:`~kvplug.core.records.manifest.KeyScheme`), asks every tier which
it holds, and says why the cached prefix stops where it stops. To name the usual reason
a second engine never hits (another model, dtype, block size, TP size, ``cache_salt``
...), it reads the fingerprint manifests of tiers that can list their records
(:class:`kvplug.RecordStore`) and, for each other scheme found there or given by the
caller, asks the tiers for the prompt's keys under that scheme. Tiers that cannot list
(mooncake) are asked about the schemes found elsewhere and given by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplug.core.keys import ChunkKey, ExtraKey, StoreKey
from kvplug.core.records.frame import RECORD_HEADER_SIZE, unpack_record
from kvplug.core.records.manifest import MANIFEST_MAX_BYTES, KeyScheme, decode_manifest
from kvplug.core.records.store import RecordStore
from kvplug.core.tier import StorageTier
from kvplug.errors import ChunkError, RecordUnreadableError

_CANNOT_LIST = "cannot list its records: only the fingerprints found in other tiers or given were checked"
#: At most this many manifests are read from one tier's listing (and as many schemes compared).
MAX_MANIFESTS = 256


@dataclass(frozen=True)
class ChunkRow:
    """One chunk of the prompt: tokens ``[start, end)``, its key, the tiers holding it."""

    index: int
    start: int
    end: int
    key: str
    tiers: tuple[str, ...]

    @property
    def digest(self) -> str:
        """The chunk hash, shortened (the key's last part)."""
        return StoreKey.parse(self.key).short()


@dataclass(frozen=True)
class OtherScheme:
    """Another scheme found in the tiers, with how much of the prompt it holds."""

    scheme: KeyScheme
    #: The fields whose values differ from the explained scheme (``FIELD_NAMES`` names).
    differs: tuple[str, ...]
    #: Leading tokens of the prompt held under this scheme, and by which tiers.
    hit_tokens: int
    tiers: tuple[str, ...]


@dataclass
class Explanation:
    """The chunk map of one prompt, its hit, and why it stops there."""

    scheme: KeyScheme
    num_tokens: int
    chunks: list[ChunkRow]
    #: Leading chunks some tier holds, and their tokens: what ``CacheEngine.lookup`` answers.
    hit_chunks: int
    hit_tokens: int
    #: Why the cached prefix ends where it does (or that the whole prompt is cached).
    reason: str
    #: Other schemes holding some of the prompt, most tokens first.
    others: list[OtherScheme]
    #: Other schemes found that hold none of it (for the "closest" hint).
    unrelated: list[OtherScheme]
    #: Tiers holding the explained scheme's own manifest (an engine with it wrote there).
    manifest_tiers: tuple[str, ...]
    #: Per tier: what explain could not do there (no listing, an error).
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def first_missing(self) -> ChunkRow | None:
        return self.chunks[self.hit_chunks] if self.hit_chunks < len(self.chunks) else None

    def to_json(self) -> dict[str, Any]:
        def scheme(s: KeyScheme) -> dict[str, Any]:
            return {"prefix": s.prefix, "fingerprint": s.fingerprint_hex, "fields": s.fields}

        return {
            "scheme": scheme(self.scheme),
            "num_tokens": self.num_tokens,
            "hit_chunks": self.hit_chunks,
            "hit_tokens": self.hit_tokens,
            "first_missing_chunk": None if self.first_missing is None else self.first_missing.index,
            "reason": self.reason,
            "chunks": [
                {"index": c.index, "start": c.start, "end": c.end, "key": c.key, "tiers": list(c.tiers)}
                for c in self.chunks
            ],
            "other_fingerprints": [
                {**scheme(o.scheme), "differs": list(o.differs), "hit_tokens": o.hit_tokens, "tiers": list(o.tiers)}
                for o in self.others
            ],
            "manifest_tiers": list(self.manifest_tiers),
            "notes": self.notes,
        }


def explain_prompt(
    tiers: Sequence[tuple[str, StorageTier]],
    scheme: KeyScheme,
    tokens: Sequence[int],
    *,
    extra_keys: Sequence[ExtraKey] = (),
    save_unfull_chunk: bool = False,
    candidates: Iterable[KeyScheme] = (),
    being_removed: Callable[[Sequence[str]], list[bool] | None] | None = None,
) -> Explanation:
    """Explain ``tokens`` under ``scheme`` over ``tiers`` (``(label, tier)``, fastest first).
    ``being_removed``: a live engine's :meth:`TierChain.being_removed`; a chunk whose removal
    is on its way (a load found it unusable) is held by no tier, as its lookups answer."""
    notes: dict[str, str] = {}
    keys = scheme.key_builder().keys(tokens, scheme.prefix, extra_keys=extra_keys, include_partial=True)
    held = _held(tiers, keys, notes)
    gone = being_removed([k.key for k in keys]) if being_removed is not None and keys else None
    if gone is not None and any(gone):
        held = [() if removing else where for where, removing in zip(held, gone)]
        which = ", ".join(str(k.index) for k, removing in zip(keys, gone) if removing)
        notes["chain"] = f"chunks {which}: a load found them unusable; their removal is on its way (a miss)"
    rows = [ChunkRow(k.index, k.start, k.end, k.key, held[i]) for i, k in enumerate(keys)]
    hit = next((i for i, row in enumerate(rows) if not row.tiers), len(rows))
    own = _held(tiers, [ChunkKey(0, 0, 0, scheme.manifest_key())], notes)[0]

    others: list[OtherScheme] = []
    unrelated: list[OtherScheme] = []
    for other in _other_schemes(tiers, scheme, candidates, notes):
        other_keys = other.key_builder().keys(tokens, other.prefix, extra_keys=extra_keys, include_partial=True)
        other_held = _held(tiers, other_keys, notes)
        other_hit = next((i for i, where in enumerate(other_held) if not where), len(other_keys))
        where = tuple(sorted({t for w in other_held[:other_hit] for t in w}))
        found = OtherScheme(
            other, tuple(scheme.differences(other)), other_keys[other_hit - 1].end if other_hit else 0, where
        )
        (others if found.hit_tokens else unrelated).append(found)
    others.sort(key=lambda o: -o.hit_tokens)
    unrelated.sort(key=lambda o: len(o.differs))
    explanation = Explanation(
        scheme, len(tokens), rows, hit, rows[hit - 1].end if hit else 0, "", others, unrelated, own, notes
    )
    explanation.reason = _reason(explanation, save_unfull_chunk)
    if gone is not None and hit < len(gone) and gone[hit]:
        missing = rows[hit]
        explanation.reason = (
            f"chunk {missing.index} (tokens {missing.start}-{missing.end}): a load found it unusable and its "
            "removal is on its way: a miss until it is stored again"
        )
    return explanation


def _held(
    tiers: Sequence[tuple[str, StorageTier]], keys: Sequence[ChunkKey], notes: dict[str, str]
) -> list[tuple[str, ...]]:
    """The labels of the tiers holding each key; a tier that fails holds nothing (noted)."""
    where: list[list[str]] = [[] for _ in keys]
    if not keys:
        return []
    for label, tier in tiers:
        try:
            answers = tier.contains([k.key for k in keys])
        except Exception as exc:  # a store that is down: say so, go on with the others
            notes[label] = f"could not answer: {type(exc).__name__}: {exc}"
            continue
        for found, at in zip(answers, where):
            if found:
                at.append(label)
    return [tuple(at) for at in where]


def _other_schemes(
    tiers: Sequence[tuple[str, StorageTier]], scheme: KeyScheme, given: Iterable[KeyScheme], notes: dict[str, str]
) -> list[KeyScheme]:
    """The schemes found in the manifests of the tiers that list, and those ``given``, but ``scheme``."""
    found: dict[tuple[str, int, str], KeyScheme] = {}
    for candidate in [*given, *(s for label, tier in tiers for s in list_manifests(label, tier, notes))]:
        ident = (candidate.prefix, candidate.chunk_size, candidate.hash_name)
        if ident != (scheme.prefix, scheme.chunk_size, scheme.hash_name) and len(found) < MAX_MANIFESTS:
            found.setdefault(ident, candidate)
    return list(found.values())


def list_manifests(label: str, tier: StorageTier, notes: dict[str, str]) -> list[KeyScheme]:
    """The schemes of the manifests a tier's listing finds (records small enough to be
    one are read; at most :data:`MAX_MANIFESTS`). A tier that cannot list: a note."""
    if not isinstance(tier, RecordStore):
        notes.setdefault(label, _CANNOT_LIST)
        return []
    schemes: list[KeyScheme] = []
    try:
        for record in tier.records():
            if record.size > MANIFEST_MAX_BYTES + RECORD_HEADER_SIZE:
                continue
            try:
                data = tier.read_record(record.digest)
                scheme = decode_manifest(unpack_record(data)) if data is not None else None
            except (ChunkError, RecordUnreadableError):  # corrupt, unreadable, or signed with a key we lack
                continue
            if scheme is not None:
                schemes.append(scheme)
                if len(schemes) >= MAX_MANIFESTS:
                    notes.setdefault(label, f"more than {MAX_MANIFESTS} fingerprint manifests: the first were compared")
                    break
    except Exception as exc:
        # A record tier whose store cannot list (mooncake) raises NotImplementedError, as
        # the cause of the tier's TierUnavailableError.
        cannot = isinstance(exc, NotImplementedError) or isinstance(exc.__cause__, NotImplementedError)
        notes.setdefault(label, _CANNOT_LIST if cannot else f"listing failed: {type(exc).__name__}: {exc}")
    return schemes


def _reason(found: Explanation, save_unfull_chunk: bool) -> str:
    missing = found.first_missing
    if not found.chunks:
        return "the prompt is empty"
    if missing is None:
        return "the whole prompt is cached"
    scheme = found.scheme
    name = f"chunk {missing.index} (tokens {missing.start}-{missing.end})"
    if missing.end - missing.start < scheme.chunk_size and not save_unfull_chunk:
        return (
            f"{name} is the last, partial chunk ({missing.end - missing.start} of {scheme.chunk_size} tokens): "
            "partial chunks are stored only with save_unfull_chunk: true"
        )
    failed = [f"{label} ({note})" for label, note in found.notes.items() if note.startswith("could not answer")]
    if failed:
        return f"{name} is in no tier that answered; tiers that did not: {', '.join(failed)}"
    if any(row.tiers for row in found.chunks[missing.index + 1 :]):
        return (
            f"{name} is missing but later chunks are held: it was evicted or removed (a corrupt chunk is) "
            "after it was stored, and a hit needs every chunk of the prefix"
        )
    holding = [o for o in found.others if o.hit_tokens > missing.start]
    if holding:
        best = holding[0]
        return (
            f"{name} is not stored under this fingerprint, but under {len(holding)} other(s): "
            f"{best.scheme.fingerprint_hex[:12]} holds {best.hit_tokens} tokens of this prompt "
            f"(in {', '.join(best.tiers)}) and differs in {', '.join(best.differs) or 'nothing recorded'}"
        )
    if found.manifest_tiers:
        return (
            f"{name} is in no tier: an engine with this fingerprint wrote to {', '.join(found.manifest_tiers)}, "
            "but not this chunk (this prefix was never stored, or it was evicted or expired)"
        )
    hint = ""
    if found.unrelated:
        closest = found.unrelated[0]
        hint = (
            f"; the stores hold {len(found.unrelated)} other fingerprint(s), none with this prompt: the closest, "
            f"{closest.scheme.fingerprint_hex[:12]}, differs in {', '.join(closest.differs)}"
        )
    return f"{name} is in no tier, and no engine with this fingerprint has written to these tiers (no manifest){hint}"
