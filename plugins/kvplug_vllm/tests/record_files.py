"""The chunk records in a disk or shm tier's folder: for the tests, and for the engine
driver, which counts them between the steps of one engine process."""

from __future__ import annotations

from pathlib import Path

from kvplug import check_record


def chunk_records(path: Path) -> list[Path]:
    """The chunk records of a disk or shm tier's folder (not the engines' fingerprint manifests,
    kvplug explain's, which stay when chunks are removed)."""
    found = sorted(path.rglob("*.kvr"))
    return [p for p in found if "fingerprint manifest" not in check_record(p.name[:64], p.read_bytes()).reason]
