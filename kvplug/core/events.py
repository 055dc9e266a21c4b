"""Events observed through the ``kvplug_on_event`` hook."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

EventKind = Literal["stored", "loaded", "evicted", "removed"]


@dataclass(frozen=True)
class KVEvent:
    """Something happened to some chunks in some tier.

    ``keys`` are chunk keys; ``token_counts`` gives the tokens per key when known
    (stored/loaded events from the cache engine), else it is empty.
    """

    kind: EventKind
    keys: tuple[str, ...]
    tier: str | None = None
    token_counts: tuple[int, ...] = ()
    timestamp: float = field(default_factory=time.time)
