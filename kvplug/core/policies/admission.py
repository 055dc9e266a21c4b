"""Admission policies: which chunks the tier chain writes to a tier at all.

Each tier has one (``tiers[i].admission``); the chain asks it before a write to that
tier is made or queued, so a tier that declines a chunk never sees it.

- ``{type: all}`` (the default): every chunk is written, as before admission existed.
- ``{type: frequency, min_hits: 2}``: a chunk is written once its key was *seen*
  ``min_hits`` times, counted in a bounded count-min sketch (:class:`FrequencySketch`).
  One-off prompts then never reach a slow tier, while a prefix that several requests
  share is written on its second sighting.

What counts as a sighting (the chain calls :meth:`AdmissionPolicy.seen`):

- a **store** of the key: the chain's ``put``, once per batch a request hands over;
- a **verified load** of the key: the chain's ``promote``, once per retrieve, after the
  chunk passed its checks.

Lookups do not count: an engine may ask them many times for one request (again on
every step a request waits to be scheduled), so a one-off prompt would reach
``min_hits`` by waiting. A store and a load happen once per request and chunk.

A chunk that a tier declined on its first store is often held by a faster tier (an
``all`` cpu tier in front of a ``frequency`` disk tier), so the second request *loads*
it instead of storing it again. On that load the chain writes the verified chunk to
every slower tier whose policy admits it now (a catch-up write): the shared prefix
reaches the disk on its second sighting although nothing stores it twice. Tiers with
the ``all`` policy get no catch-up writes (as before: only stores write them).

Promotion (a chunk found in a slow tier written to the faster ones) respects
admission: the load counts as a sighting first, then each faster tier's policy decides.
A faster ``frequency`` tier thus holds a chunk once it was stored and loaded
``min_hits`` times in all, the same rule as for any other write to that tier.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import xxhash
from pydantic import ConfigDict, Discriminator, Field, Tag

from kvplug.core.components import CheckedModel
from kvplug.core.config_types import Bounded

#: Counters saturate here (one byte each).
MAX_HITS = 255
#: Bounds of ``sketch_keys``: the sketch takes ``SKETCH_DEPTH * AGING_FACTOR`` one-byte
#: counters per key it is sized for (rounded up to a power of two): 4 MiB for 100k keys.
MIN_SKETCH_KEYS = 64
MAX_SKETCH_KEYS = 2**20
#: Rows of the sketch: each key increments one counter per row, and its count is the
#: smallest of them (more rows: fewer overestimates, more work per key).
SKETCH_DEPTH = 4
#: Counts halve after this many sightings per key the sketch is sized for (TinyLFU's
#: sample size W = 10 x the entries), so what was popular long ago fades.
AGING_FACTOR = 10

_HALF = bytes(i >> 1 for i in range(256))


class FrequencySketch:
    """A count-min sketch of how often each key was seen, in bounded memory.

    ``SKETCH_DEPTH`` rows of ``width`` one-byte counters (``width``: the sightings of one
    aging period, ``AGING_FACTOR * keys``, rounded up to a power of two), so its memory
    is fixed whatever the number of distinct keys. Sized by the period, not by ``keys``:
    a period of one-off keys then fills about a tenth of each row, and a key seen once
    reads as seen twice only where all its counters were taken (well under 1 %); a row
    of ``keys`` counters would be full within the period and admit about half of them.
    Keys are hashed with xxh3-64 (stable across processes, never Python's ``hash()``);
    the rows take the counters at ``h1 + i * h2`` (double hashing). Increments are
    conservative (only the counters at the key's current minimum grow), which keeps
    overestimates from collisions low; a key's count is never *under* its true
    number of sightings (up to ``MAX_HITS``) until the next aging.

    Aging: after ``AGING_FACTOR * keys`` increments every counter is halved.

    Not thread-safe; :class:`FrequencyAdmission` locks around it.
    """

    def __init__(self, keys: int) -> None:
        if keys < 1:
            raise ValueError(f"a frequency sketch needs keys >= 1, got {keys}")
        self.width = 1 << max(AGING_FACTOR * keys - 1, 1).bit_length()
        self._mask = self.width - 1
        self._rows = [bytearray(self.width) for _ in range(SKETCH_DEPTH)]
        #: Increments until the next halving.
        self.sample_size = AGING_FACTOR * keys
        self._increments = 0
        #: How many times the counters were halved.
        self.agings = 0

    @property
    def nbytes(self) -> int:
        """Bytes of counters held: fixed at construction."""
        return sum(len(row) for row in self._rows)

    def _slots(self, key: str) -> list[int]:
        digest = xxhash.xxh3_64_intdigest(key.encode())
        h1, h2 = digest & 0xFFFFFFFF, (digest >> 32) | 1
        return [(h1 + i * h2) & self._mask for i in range(SKETCH_DEPTH)]

    def add(self, key: str) -> None:
        """Count one sighting of ``key``."""
        slots = self._slots(key)
        current = min(row[slot] for row, slot in zip(self._rows, slots))
        if current < MAX_HITS:
            for row, slot in zip(self._rows, slots):
                if row[slot] == current:
                    row[slot] = current + 1
        self._increments += 1
        if self._increments >= self.sample_size:
            self._age()

    def estimate(self, key: str) -> int:
        """Sightings of ``key`` since it was last aged: at least the true number (up to
        ``MAX_HITS``), more only where other keys share all its counters."""
        return min(row[slot] for row, slot in zip(self._rows, self._slots(key)))

    def _age(self) -> None:
        for row in self._rows:
            row[:] = row.translate(_HALF)
        self._increments = 0
        self.agings += 1


class AdmissionPolicy(ABC):
    """Decides which chunks the tier chain writes to one tier (see the module docstring).

    Thread-safe: the chain calls it from the store path and the load path at once.
    """

    name: ClassVar[str]
    #: True when :meth:`admit` answers yes to every key whatever was seen: the chain
    #: then neither reports sightings to it nor makes catch-up writes for it.
    admits_everything: ClassVar[bool] = False

    @abstractmethod
    def seen(self, keys: Sequence[str]) -> None:
        """Count one sighting of each distinct key (a store or a verified load)."""

    @abstractmethod
    def admit(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key may be written to the tier now (counts nothing)."""


class AdmitAll(AdmissionPolicy):
    """Every chunk is written (``admission: {type: all}``, the default)."""

    name = "all"
    admits_everything = True

    def seen(self, keys: Sequence[str]) -> None:
        pass

    def admit(self, keys: Sequence[str]) -> list[bool]:
        return [True] * len(keys)


class FrequencyAdmission(AdmissionPolicy):
    """A chunk is written once its key was seen ``min_hits`` times (``admission: {type:
    frequency}``), counted in a :class:`FrequencySketch` sized for ``sketch_keys``."""

    name = "frequency"

    def __init__(self, min_hits: int = 2, sketch_keys: int = 100_000) -> None:
        if not 1 <= min_hits <= MAX_HITS:
            raise ValueError(f"min_hits must be from 1 to {MAX_HITS}, got {min_hits}")
        self.min_hits = min_hits
        self.sketch = FrequencySketch(sketch_keys)
        self._lock = threading.Lock()

    def seen(self, keys: Sequence[str]) -> None:
        with self._lock:
            for key in dict.fromkeys(keys):  # a key twice in one batch is one sighting
                self.sketch.add(key)

    def admit(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [self.sketch.estimate(key) >= self.min_hits for key in keys]


class AdmitAllConfig(CheckedModel):
    """``admission: {type: all}``: every chunk is written to the tier."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["all"] = Field(default="all", description="all: every chunk is written.")


class FrequencyAdmissionConfig(CheckedModel):
    """``admission: {type: frequency, min_hits: 2, sketch_keys: 100000}``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["frequency"] = Field(
        default="frequency", description="frequency: a chunk is written once it was seen min_hits times."
    )
    min_hits: Annotated[int, Bounded(1, MAX_HITS, "sightings")] = Field(
        default=2,
        description="Sightings (stores and verified loads, not lookups) of a chunk before it is written to the tier.",
    )
    sketch_keys: Annotated[int, Bounded(MIN_SKETCH_KEYS, MAX_SKETCH_KEYS, "keys")] = Field(
        default=100_000,
        description="Distinct chunks the frequency sketch is sized for: counts halve after 10 x this many "
        "sightings, and the sketch holds 4 rows of one-byte counters for those sightings (4 MiB for 100000), "
        "whatever the number of chunks seen.",
    )


def _admission_type(value: Any) -> Any:
    # A callable discriminator: CheckedModel's before-validators rule out pydantic's
    # field-name form. A missing or unknown type gets the custom error below.
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


#: A tier's ``admission`` setting: one of the configs above, chosen by ``type``.
AdmissionConfig = Annotated[
    Annotated[AdmitAllConfig, Tag("all")] | Annotated[FrequencyAdmissionConfig, Tag("frequency")],
    Discriminator(
        _admission_type,
        custom_error_type="admission_type",
        custom_error_message="must be a mapping whose type is 'all' or 'frequency'",
    ),
]


def make_admission_policy(config: AdmitAllConfig | FrequencyAdmissionConfig) -> AdmissionPolicy:
    """The policy a tier's ``admission`` setting describes (a new one: its own sketch)."""
    if isinstance(config, FrequencyAdmissionConfig):
        return FrequencyAdmission(config.min_hits, config.sketch_keys)
    return AdmitAll()
