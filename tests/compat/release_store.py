"""The stores the 0.2 release wrote (``release_0_2/``, made by ``write_release_store.py``), for
the byte-compatibility tests of every tier: the core's (disk, s3) and the valkey and mooncake
plugins' (which load this module by its path: it lives with the fixtures it reads)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

FIXTURES = Path(__file__).resolve().parent / "release_0_2"
MANIFEST: dict[str, Any] = json.loads((FIXTURES / "manifest.json").read_text(encoding="utf-8"))
#: v1: written without an integrity key; v2: with the manifest's test key (a keyed MAC).
MODES = ("v1", "v2")
#: The record header every persistent tier writes before a value (kvplug.core.records.frame).
HEADER_BYTES = 64


def release_items() -> list[tuple[str, bytes]]:
    """The (key, value) pairs the release stored, each value checked against the manifest's sha256."""
    items = []
    for entry in MANIFEST["values"]:
        value = hashlib.shake_256(entry["seed"].encode()).digest(entry["size"])  # the manifest's value_recipe
        assert hashlib.sha256(value).hexdigest() == entry["sha256"], entry["key"]
        items.append((entry["key"], value))
    return items


def release_records(tier: str, mode: str) -> dict[str, bytes]:
    """What the release's ``tier`` stored in ``mode``: stored name -> raw bytes.

    Names are paths relative to the store's folder for disk and s3 (file://), and the
    server's key or object names for valkey and mooncake.
    """
    records = {}
    for name, info in MANIFEST["tiers"][tier][mode]["stored"].items():
        data = (FIXTURES / info["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == info["sha256"], info["file"]
        records[name] = data
    return records


def release_folder(tier: str, mode: str) -> Path:
    return FIXTURES / MANIFEST["tiers"][tier][mode]["folder"]


def flip_one_byte(record: bytes) -> bytes:
    """``record`` with one byte flipped: mid-value, or in the header's last byte (its
    checksum or MAC) when the value is empty."""
    damaged = bytearray(record)
    value_bytes = len(record) - HEADER_BYTES
    damaged[HEADER_BYTES + value_bytes // 2 if value_bytes else HEADER_BYTES - 1] ^= 0x01
    return bytes(damaged)


@contextmanager
def integrity_key_of(mode: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's integrity key as the release had it for ``mode``, set the way a
    deployment sets it (``KVPLUG_INTEGRITY_KEY``). The record module resolves the key
    once per process: it is made to re-read the environment here and again on exit
    (lazily, so after ``monkeypatch`` has restored it). Request the fixture that uses this
    before any fixture that makes tiers, so that it is torn down after them."""
    from kvplug.core.records import frame as record

    monkeypatch.delenv("KVPLUG_INTEGRITY_KEY_FILE", raising=False)
    key = MANIFEST["integrity_key"][mode]
    if key is None:
        monkeypatch.delenv("KVPLUG_INTEGRITY_KEY", raising=False)
    else:
        monkeypatch.setenv("KVPLUG_INTEGRITY_KEY", key)
    record.set_integrity_key(...)
    try:
        assert (record.integrity_key() is None) == (key is None)
        yield
    finally:
        record.set_integrity_key(...)
