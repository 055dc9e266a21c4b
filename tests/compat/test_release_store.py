"""The record formats stay byte-compatible. A disk folder and an s3 (``file://``)
store written by the 0.2 release (``release_0_2/``, see ``write_release_store.py``) are read by
today's tiers, today's tiers write the very same bytes, and a damaged release record is a
counted miss; each without an integrity key (record v1) and with one (v2).

The byte comparison covers every record file (disk: ``<ab>/<digest>.kvr``; s3: ``<ab>/<digest>``).
Dot files are left out: the disk tier's usage ledger ``.kvplug-usage`` is the folder's byte
total, budget bookkeeping rather than a record, which the tier layer may keep as it likes (the
read tests do open the release's folder with its ledger in place); both tiers' temp files
start with a dot or are gone once the tier is closed. Record files' times (the disk tier's
LRU order) are metadata, not bytes, and are not compared.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from release_store import (
    MANIFEST,
    MODES,
    flip_one_byte,
    integrity_key_of,
    release_folder,
    release_items,
    release_records,
)

from kvplug import PluginRegistry, StorageTier
from kvplug.testing import tier_context

TIERS = ("disk", "s3")


def tier_options(tier: str, folder: Path) -> dict[str, Any]:
    return {"path": str(folder)} if tier == "disk" else {"url": f"file://{folder}"}


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    with integrity_key_of(request.param, monkeypatch):
        yield request.param


@pytest.fixture
def open_tier() -> Iterator[Callable[[str, Path], StorageTier]]:
    """Tiers opened through the plugin registry, as a config names them; closed at the end."""
    opened: list[StorageTier] = []

    def make(tier: str, folder: Path) -> StorageTier:
        cls = PluginRegistry(plugin_filter=tier).storage_tiers()[tier]
        opened.append(cls(cls.Config(**tier_options(tier, folder)), tier_context()))
        return opened[-1]

    yield make
    for tier in opened:
        tier.close()


def copy_release_store(tier: str, mode: str, target: Path) -> Path:
    """The release's store of ``tier`` as the release left it (the disk tier's empty shard folders too)."""
    shutil.copytree(release_folder(tier, mode), target)
    for name in MANIFEST["tiers"][tier].get("empty_folders", []):
        (target / name).mkdir()
    return target


def record_files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` but dot files, by relative path."""
    return {
        path.relative_to(folder).as_posix(): path.read_bytes()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not any(part.startswith(".") for part in path.relative_to(folder).parts)
    }


@pytest.mark.parametrize("tier", TIERS)
def test_release_store_is_read(mode: str, tier: str, tmp_path: Path, open_tier) -> None:
    store = open_tier(tier, copy_release_store(tier, mode, tmp_path / "store"))
    keys = [key for key, _ in release_items()]
    assert store.contains(keys) == [True] * len(keys)
    got = store.get(keys)
    assert [None if value is None else bytes(value) for value in got] == [value for _, value in release_items()]
    assert store.stats().extra.get("corrupt", 0) == 0


@pytest.mark.parametrize("tier", TIERS)
def test_writes_the_release_bytes(mode: str, tier: str, tmp_path: Path, open_tier) -> None:
    folder = tmp_path / "store"
    store = open_tier(tier, folder)
    store.put(release_items())
    store.flush()
    store.close()
    written = record_files(folder)
    expected = release_records(tier, mode)
    assert sorted(written) == sorted(expected)
    for name, data in expected.items():
        assert written[name] == data, f"{tier} {mode}: {name} differs from the release's record"


@pytest.mark.parametrize("tier", TIERS)
def test_a_flipped_byte_is_a_counted_corrupt_miss(mode: str, tier: str, tmp_path: Path, open_tier) -> None:
    folder = copy_release_store(tier, mode, tmp_path / "store")
    for name in release_records(tier, mode):
        path = folder / name
        path.write_bytes(flip_one_byte(path.read_bytes()))
    store = open_tier(tier, folder)
    keys = [key for key, _ in release_items()]
    assert store.get(keys) == [None] * len(keys)
    assert store.stats().extra["corrupt"] == len(keys)
    assert store.contains(keys) == [False] * len(keys)  # a corrupt record is deleted
