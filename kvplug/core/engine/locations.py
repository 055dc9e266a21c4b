"""Where a prompt's cached prefix is: one :class:`ChunkLocation` per chunk.

A cache engine answers a lookup with typed locations (:meth:`kvplug.CacheEngine.locate`):
the medium of the fastest tier holding each chunk, that tier's name and the chunk's
tokens, so an adapter decides how to load a prefix (at once from memory, in the
background from disk or a remote store) by its medium, without mapping tier names back
to media through the config. :func:`merge_locations` joins the answers of several
ranks (tensor-parallel workers, each holding its own heads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplug.core.keys import ChunkKey
from kvplug.core.tier import MEDIA, Medium, StorageTier


@dataclass(frozen=True)
class ChunkLocation:
    """One chunk of a cached prefix: the fastest tier holding it, and its tokens."""

    #: The medium of that tier (:attr:`kvplug.StorageTier.medium`).
    medium: Medium
    #: That tier's name (its ``type`` in the config).
    tier: str
    #: The chunk's token count (the last chunk of a prompt may be partial).
    tokens: int
    #: The chunk's chained hash in hex, its key without the fingerprint prefix (the same on
    #: every rank): a load of the prefix rebuilds its keys from these
    #: (``CacheEngine.chunk_keys(..., hashes=)``) instead of hashing the prompt again. "": unknown.
    #: Not compared: two locations are equal when they say the same place.
    chunk_hash: str = field(default="", compare=False)
    #: That tier's position in its chain (0 the fastest; None: unknown), which tells two tiers
    #: of one type apart (two ``disk`` folders). Not compared, so that a location equals one
    #: of the same medium, tier type and tokens, as before it was kept.
    tier_index: int | None = field(default=None, compare=False)

    @property
    def tier_label(self) -> str:
        """``<index>:<type>``, as the chain's per-tier metrics name the tier (``TierChain.labels``);
        the type alone when the index is unknown."""
        return self.tier if self.tier_index is None else f"{self.tier_index}:{self.tier}"

    def to_json(self) -> list[Any]:
        return [self.medium, self.tier, self.tokens, self.chunk_hash, self.tier_index]

    @classmethod
    def from_json(cls, raw: Any) -> ChunkLocation:
        """The inverse of :meth:`to_json`; ``ValueError`` names what is wrong with ``raw``."""
        if not (isinstance(raw, list) and len(raw) == 5):
            raise ValueError("a chunk location is [medium, tier, tokens, chunk hash, tier index]")
        medium, tier, tokens, chunk_hash, tier_index = raw
        if medium not in MEDIA or not isinstance(tier, str) or type(tokens) is not int or tokens < 0:
            raise ValueError(f"a chunk location of medium one of {MEDIA}, a tier name and a token count: {raw!r}")
        if not is_chunk_hash(chunk_hash) and chunk_hash != "":
            raise ValueError(f"a chunk hash is hex digits: {str(chunk_hash)[:80]!r}")
        if tier_index is not None and (type(tier_index) is not int or tier_index < 0):
            raise ValueError(f"a chunk location's tier index is a position in its chain or null: {tier_index!r}")
        return cls(medium, tier, tokens, chunk_hash, tier_index)


def is_chunk_hash(value: Any) -> bool:
    """Whether ``value`` can be a chunk's chained hash: 16 to 128 lowercase hex digits."""
    return isinstance(value, str) and 16 <= len(value) <= 128 and all(c in "0123456789abcdef" for c in value)


def chunk_hash(key: str) -> str:
    """A chunk key's hash part (what follows its ``<format version>/<fingerprint hex>/`` prefix)."""
    return key.rpartition("/")[2]


def answers_inline(tier: StorageTier) -> bool:
    """Whether ``tier`` answers lookups on the caller's thread: memory, or ``inline_lookups``."""
    return tier.medium == "memory" or tier.inline_lookups


def hit_tokens(locations: Sequence[ChunkLocation]) -> int:
    """The length of the cached prefix ``locations`` describe."""
    return sum(location.tokens for location in locations)


def merge_locations(answers: Sequence[Sequence[ChunkLocation]]) -> list[ChunkLocation]:
    """The prefix every rank holds, each chunk at the slowest of the ranks' media: a chunk
    counts as in memory only if every rank has it in a memory tier (ties: the first name).
    Ranks that found partial chunks of different lengths there (tails of different prompts,
    ``block_granular_hits``) share none of them: the prefix ends before it."""
    if not answers:
        return []
    merged = []
    for index in range(min(len(answer) for answer in answers)):
        first = answers[0][index]
        if any(answer[index].tokens != first.tokens for answer in answers):
            break
        chunk = sorted((answer[index] for answer in answers), key=lambda loc: (-MEDIA.index(loc.medium), loc.tier))
        merged.append(
            ChunkLocation(chunk[0].medium, chunk[0].tier, first.tokens, first.chunk_hash, chunk[0].tier_index)
        )
    return merged


def locate_inline(
    keys: Sequence[ChunkKey],
    records: Sequence[str],
    per_chunk: int,
    tiers: Sequence[StorageTier],
    *,
    chunk_size: int,
    save_unfull_chunk: bool,
) -> list[ChunkLocation] | None:
    """The locations of the chunks ``keys`` when those of the chain's ``tiers`` (in order) that answer inline
    (:func:`answers_inline`) give them alone, without asking a slower tier; ``None`` when
    a slower tier could add to them. ``records``: ``per_chunk`` record keys per chunk, chunk
    by chunk (one per head group: a chunk is held when every record of it is).

    They answer alone when they hold every whole chunk of the prompt, and the last,
    partial chunk too unless the config never stores one (``save_unfull_chunk``).
    """
    where: list[int | None] = [None] * len(keys)  # per chunk, the position of the tier holding it
    for index, tier in enumerate(tiers):
        if not answers_inline(tier):
            continue
        ask = [i for i, found in enumerate(where) if found is None]
        if not ask:
            break
        try:
            found = tier.contains([records[i * per_chunk + j] for i in ask for j in range(per_chunk)])
        except Exception:  # the full lookup asks again, and counts the error
            return None
        for n, i in enumerate(ask):
            if all(found[n * per_chunk : (n + 1) * per_chunk]):
                where[i] = index
    held = next((i for i, found in enumerate(where) if found is None), len(keys))
    partial_left = held == len(keys) - 1 and keys[-1].num_tokens < chunk_size
    if held < len(keys) and not (partial_left and not save_unfull_chunk):
        return None
    return [
        ChunkLocation(tiers[index].medium, tiers[index].name, key.num_tokens, chunk_hash(key.key), index)
        for index, key in zip(where[:held], keys)
        if index is not None
    ]
