"""Tier ``s3``: values as objects in S3 or any writable fsspec store.

Each object is a :mod:`kvplug.core.records.frame` frame (header with the key's digest
and checksums, then the value) named by the key's sha256 digest
(:mod:`kvplug_s3.backend`). The record tier base (:class:`kvplug.RecordTier`) does
the rest: every read is verified (a torn, truncated, bit-flipped or swapped object
is a miss, counted, and deleted); one object operation per request, run
concurrently on the tier's own event loop, each under a deadline, bounded retries
and a circuit breaker: a store that is down costs one failed batch, then lookups
miss and puts are dropped at no cost until the store is back. The prefix is
listed on start (``scan_on_start``), so ``stats()`` and ``max_bytes`` include
objects stored before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from kvplug import RecordTier
from kvplug_s3.backend import open_object_backend
from kvplug_s3.config import S3TierConfig
from kvplug_s3.location import s3_location_config
from kvplug_s3.objects import ObjectBackend


class S3Tier(RecordTier):
    """A remote object store as a storage tier; see the module docstring."""

    name = "s3"
    medium = "remote"
    Config = S3TierConfig

    config: S3TierConfig

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> S3TierConfig | None:
        """``s3://bucket/prefix`` and other writable fsspec URLs (see :mod:`kvplug_s3.location`)."""
        return s3_location_config(location, options)

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> ObjectBackend:
        return open_object_backend(
            self.config, loop, record_bound=lambda: self.context.max_record_bytes, read_only=self.context.read_only
        )
