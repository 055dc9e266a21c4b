"""Which locations ``kvplug store`` opens as an object store: URLs of writable fsspec protocols."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvplug import UNBOUNDED_BYTES
from kvplug_s3.config import READ_ONLY_PROTOCOLS, S3TierConfig, fsspec_protocols

#: Folders are the disk tier's: ``file://`` too.
_LOCAL_PROTOCOLS = frozenset({"file", "local"})


def s3_location_config(location: str, options: Mapping[str, Any]) -> S3TierConfig | None:
    """The inspection config of ``s3://bucket/prefix`` or another writable fsspec URL,
    or ``None`` for a folder, ``file://`` or a scheme fsspec does not know."""
    if "://" not in location:
        return None
    protocol = location.split("://", 1)[0].lower()
    known, _ = fsspec_protocols()
    if protocol in _LOCAL_PROTOCOLS or protocol in READ_ONLY_PROTOCOLS or protocol not in known:
        return None
    given = {name: value for name, value in options.items() if value is not None}
    unknown = sorted(set(given) - {"endpoint_url"})
    if unknown:
        raise ValueError(f"option(s) {', '.join(unknown)} do not apply to an object store; it takes endpoint_url")
    # Nothing is evicted while a store is inspected.
    return S3TierConfig(url=location, max_bytes=UNBOUNDED_BYTES, **given)
