"""``kvplug store`` on a real disk tier folder written by a real cache engine."""

from __future__ import annotations

import hashlib
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import torch
from core_helpers import VLLM_FLASH

from kvplug import UNBOUNDED_BYTES, CacheEngine, Fingerprint, KVLayout, load_config
from kvplug.cli.store import _budget
from kvplug.core.records.frame import RECORD_HEADER_SIZE, pack_record
from kvplug.core.records.manifest import MANIFEST_MAGIC

LAYOUT = KVLayout(VLLM_FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def fill_store(folder: Path, prompts: int = 3) -> list[str]:
    """Store ``prompts`` prompts of two chunks each; returns the chunk keys."""
    config = load_config(
        engine_extra={
            "kvplug": {
                "chunk_size": 8,
                "store": {"queue": {"mode": "sync"}},
                "tiers": [{"type": "disk", "path": str(folder)}],
            }
        },
        env={},
    ).config
    caches = [torch.randn(2, 32, 4, 2, 8).to(torch.bfloat16) for _ in range(2)]
    keys = []
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")) as engine:
        for p in range(prompts):
            tokens = list(range(p * 1000, p * 1000 + 16))
            engine.store(tokens, caches, torch.arange(16))
            keys += [chunk.key for chunk in engine.chunk_keys(tokens)]
        engine.flush()
    return keys


def kvplug(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="250")
    env.pop("KVPLUG_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", "store", *args], env=env, capture_output=True, text=True, timeout=120
    )


def record_files(folder: Path) -> list[Path]:
    """The chunk records (not the engine's fingerprint manifest, kvplug explain's)."""
    return sorted(f for f in folder.glob("*/*.kvr") if MANIFEST_MAGIC not in f.read_bytes())


def test_stats_ls_verify_and_gc(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    fill_store(folder)
    files = record_files(folder)
    assert len(files) == 6

    stats = kvplug("stats", str(folder))
    assert stats.returncode == 0, stats.stderr
    assert re.search(r"(│ records\s*│\s*7 │|^records: 7$)", stats.stdout, re.M), (
        stats.stdout
    )  # and the fingerprint manifest

    listing = kvplug("ls", str(folder))
    assert listing.returncode == 0, listing.stderr
    assert "7 records in" in listing.stdout
    assert listing.stdout.count("fingerprint manifest") == 1
    assert listing.stdout.count("bfloat16 [2, 2, 8, 16]") == 6
    assert all(f.name[:64] in listing.stdout for f in files)
    # a disk record's time is its LRU clock, which reads move: not "written"
    assert "last used" in listing.stdout and "written" not in listing.stdout, listing.stdout

    assert kvplug("verify", str(folder)).returncode == 0

    damaged = bytearray(files[0].read_bytes())
    damaged[-1] ^= 0xFF
    files[0].write_bytes(bytes(damaged))
    verify = kvplug("verify", str(folder))
    assert verify.returncode == 1
    assert f"corrupt: {files[0].name[:64]}" in verify.stdout and "checksum" in verify.stdout
    assert files[0].exists()  # verify never removes anything

    cleaned = kvplug("gc", str(folder))
    assert cleaned.returncode == 0, cleaned.stderr
    assert re.search(r"│ removed\s*│\s*1 │", cleaned.stdout), cleaned.stdout
    assert not files[0].exists() and len(record_files(folder)) == 5
    assert kvplug("verify", str(folder)).returncode == 0


def test_stats_show_the_budget_in_words_not_the_inspection_sentinel(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    fill_store(folder, prompts=1)
    stats = kvplug("stats", str(folder))
    assert stats.returncode == 0, stats.stderr
    assert re.search(
        r"│ tier max_bytes\s*│\s*unbounded \(opened for inspection: nothing is evicted\) │", stats.stdout
    ), stats.stdout
    assert str(UNBOUNDED_BYTES) not in stats.stdout
    assert _budget(3 * 1024**3) == "3.0 GiB (3221225472 bytes)" and _budget(-1).startswith("unbounded")


def test_gc_removes_an_older_format_version_and_keeps_a_newer_kvplugs_records(tmp_path: Path) -> None:
    """A record of an older format version no kvplug reads any more is ``incompatible`` and gc
    removes it; one a newer kvplug wrote (a newer chunk frame or record version, in a store shared
    during a rolling upgrade) is ``newer``: reported, kept, and not a verify failure."""
    folder = tmp_path / "cache"
    keys = fill_store(folder, prompts=2)[:3]
    paths = []
    for key in keys:
        digest = hashlib.sha256(key.encode()).hexdigest()
        paths.append(folder / digest[:2] / f"{digest}.kvr")
    older, newer_chunk, newer_record = paths

    value = bytearray(older.read_bytes()[RECORD_HEADER_SIZE:])
    struct.pack_into("<H", value, 4, 0)  # chunk frame version 0: older than any kvplug reads
    older.write_bytes(pack_record(keys[0], bytes(value)))  # a valid record around it
    value = bytearray(newer_chunk.read_bytes()[RECORD_HEADER_SIZE:])
    struct.pack_into("<H", value, 4, 9)  # chunk frame version 9: from a future kvplug
    newer_chunk.write_bytes(pack_record(keys[1], bytes(value)))
    record = bytearray(newer_record.read_bytes())
    struct.pack_into("<HH", record, 4, 9, 128)  # record version 9, with a header of its own size
    newer_record.write_bytes(bytes(record))

    verify = kvplug("verify", str(folder))
    assert verify.returncode == 0, verify.stdout  # neither is corrupt
    cleaned = kvplug("gc", str(folder))
    assert cleaned.returncode == 0, cleaned.stdout
    assert newer_chunk.exists() and newer_record.exists()  # the upgraded engines' records stay
    assert not older.exists()
    assert re.search(r"│ removed\s*│\s*1 │", cleaned.stdout), cleaned.stdout
    assert "incompatible" in verify.stdout and "version 0" in verify.stdout
    assert "chunk frame version 9 is newer" in verify.stdout and "record version 9 is newer" in verify.stdout
    assert re.search(r"│ newer\s*│\s*2 │", verify.stdout), verify.stdout


def test_unknown_store_kind_says_what_to_install(tmp_path: Path) -> None:
    env = dict(os.environ, KVPLUG_PLUGINS="cpu", COLUMNS="250")
    result = subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", "store", "stats", "s3://bucket/prefix"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert "pip install kvplug-s3" in " ".join(result.stderr.split())


def test_ls_refuses_a_negative_limit_naming_it(tmp_path: Path) -> None:
    """A negative ``--limit`` is an error naming the option, not a listing cut from the oldest end."""
    folder = tmp_path / "store"
    fill_store(folder, prompts=1)
    listed = kvplug("ls", str(folder), "--limit", "-1")
    assert listed.returncode != 0
    assert "--limit" in listed.stderr and "greater than or equal to 0" in listed.stderr


def test_the_store_commands_bound_records_as_the_engine_does(tmp_path: Path, monkeypatch) -> None:
    """The bound ``kvplug store`` reads records under is the engine's for the same config."""
    from kvplug.cli.record_bound import record_bound
    from kvplug.core.engine.chunk_store import record_bound as engine_bound
    from kvplug.core.plugins import get_registry
    from kvplug.core.serializer_factory import make_serializer

    config_file = tmp_path / "kvplug.yaml"
    config_file.write_text("max_chunk_bytes: 3MiB\nserializer: {type: lz4}\n")
    monkeypatch.setenv("KVPLUG_CONFIG", str(config_file))
    serializer = make_serializer(load_config().config, get_registry())
    assert record_bound(None).read == record_bound(None).engine == engine_bound(serializer, None)
    assert record_bound("1 MiB").read == 1 << 20 and record_bound("1 MiB").engine == engine_bound(serializer, None)


def test_gc_fails_when_it_leaves_an_entry_verify_fails_on(tmp_path: Path) -> None:
    """A link named like a record (foreign: never read, never removed) fails gc as it fails
    verify: a script's ``kvplug store gc && ...`` must not read the store as clean."""
    folder = tmp_path / "cache"
    fill_store(folder, prompts=1)
    digest = hashlib.sha256(b"planted link").hexdigest()
    (folder / digest[:2]).mkdir(exist_ok=True)
    (folder / digest[:2] / f"{digest}.kvr").symlink_to("/etc/passwd")
    assert kvplug("verify", str(folder)).returncode == 1
    cleaned = kvplug("gc", str(folder))
    assert cleaned.returncode == 1, cleaned.stdout + cleaned.stderr
    assert re.search(r"│ foreign\s*│\s*1 │", cleaned.stdout) and "left: 1 entries" in cleaned.stdout, cleaned.stdout
    assert (folder / digest[:2] / f"{digest}.kvr").is_symlink()  # left alone, and the records with it
    assert kvplug("verify", str(folder)).returncode == 1


def test_a_scheme_no_installed_tier_opens_is_not_a_hint_to_install_it_again() -> None:
    """With kvplug-s3 installed, ``mooncake://`` (a store kvplug store cannot list) or a typo
    (``s4://``) said "kvplug-s3 does: pip install kvplug-s3"."""
    for location in ("mooncake://host/prefix", "s4://bucket/prefix"):
        result = kvplug("ls", location)
        assert result.returncode == 2, result.stderr
        message = " ".join(result.stderr.split())
        assert "pip install" not in message, message
        scheme = location.split("://")[0]
        assert f"no installed tier opens {scheme}:// locations (kvplug-s3, installed," in message, message


def test_a_config_this_host_cannot_load_does_not_stop_an_inspection(tmp_path: Path) -> None:
    """$KVPLUG_CONFIG names a tier not installed here (the engine's host has it): the store is
    still inspected, under the bound its max_chunk_bytes gives; a serializer not installed here
    leaves the bound unknown: said on stderr, the default used, and gc removes none for its size."""
    folder = tmp_path / "cache"
    fill_store(folder, prompts=1)
    config = tmp_path / "engine.yaml"
    env = dict(os.environ, COLUMNS="250", KVPLUG_CONFIG=str(config))
    env.pop("KVPLUG_PLUGINS", None)

    def run(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvplug.cli.main", "store", command, str(folder)],
            env=env, capture_output=True, text=True, timeout=120,
        )  # fmt: skip

    config.write_text("max_chunk_bytes: 8MiB\ntiers: [{type: not-installed-here}]\n")
    for command in ("ls", "verify", "gc"):
        done = run(command)
        assert done.returncode == 0 and "warning" not in done.stderr, done.stdout + done.stderr
    config.write_text("max_chunk_bytes: 8MiB\nserializer: {type: not-installed-here}\n")
    for command in ("ls", "verify", "gc"):
        done = run(command)
        assert done.returncode == 0, done.stdout + done.stderr
        message = " ".join(done.stderr.split())
        assert "warning: the engine's bound on records is not known" in message and "not-installed-here" in message
        assert "records are read up to the default config's bound" in message
    assert len(record_files(folder)) == 2


def test_verify_says_what_it_could_not_check_and_can_require_signatures(tmp_path: Path) -> None:
    """Without the integrity key, signed records are ``unverified``: verify exits 0 (they may be
    fine) but says on stderr that their bytes were not checked; ``--require-signed`` refuses to
    run without the key (a check that passed unchecked would hide a cron's missing key) and,
    with it, passes a store of signed records."""
    from kvplug.core.records import frame

    key = "integrity-key-for-tests-0123456789"
    folder = tmp_path / "cache"
    frame.set_integrity_key(key.encode())
    try:
        fill_store(folder, prompts=1)
    finally:
        frame.set_integrity_key(...)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPLUG_INTEGRITY_KEY", "KVPLUG_PLUGINS"))}

    def verify(*args: str, **more: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kvplug.cli.main", "store", "verify", *args, str(folder)]
        return subprocess.run(
            command, env={**env, "COLUMNS": "250", **more}, capture_output=True, text=True, timeout=120
        )

    unkeyed = verify()
    assert unkeyed.returncode == 0, unkeyed.stderr
    assert re.search(r"│ unverified\s*│\s*3 │", unkeyed.stdout), unkeyed.stdout
    assert "3 records are signed with an integrity key and this process has none" in unkeyed.stderr, unkeyed.stderr
    refused = verify("--require-signed")
    assert refused.returncode == 2 and "KVPLUG_INTEGRITY_KEY" in refused.stderr, refused.stderr
    assert "verification" not in refused.stdout  # refused before any record is read
    keyed = verify("--require-signed", KVPLUG_INTEGRITY_KEY=key)
    assert keyed.returncode == 0, keyed.stdout + keyed.stderr
    assert re.search(r"│ ok\s*│\s*3 │", keyed.stdout) and "warning" not in keyed.stderr, keyed.stdout


def test_verify_require_signed_fails_on_records_whose_signature_it_could_not_check(tmp_path: Path) -> None:
    """With ``--require-signed`` every record must be signed and its signature checked: a record
    of another record version (a later kvplug's, or one no kvplug reads) carries no MAC this
    process checks, so it fails the check (exit 1, named on stderr), though plain verify keeps
    passing it. A newer chunk frame inside a signed record is checked: it passes."""
    from kvplug.core.records import frame

    key = "integrity-key-for-tests-0123456789"
    folder = tmp_path / "cache"
    frame.set_integrity_key(key.encode())
    try:
        keys = fill_store(folder, prompts=2)
        digest = hashlib.sha256(keys[1].encode()).hexdigest()
        chunk = folder / digest[:2] / f"{digest}.kvr"
        value = bytearray(chunk.read_bytes()[RECORD_HEADER_SIZE:])
        struct.pack_into("<H", value, 4, 9)  # chunk frame version 9 from a future kvplug, signed
        chunk.write_bytes(pack_record(keys[1], bytes(value)))
    finally:
        frame.set_integrity_key(...)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVPLUG_INTEGRITY_KEY", "KVPLUG_PLUGINS"))}
    env.update(COLUMNS="250", KVPLUG_INTEGRITY_KEY=key)

    def verify(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kvplug.cli.main", "store", "verify", *args, str(folder)]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    assert verify("--require-signed").returncode == 0, "a signed record of a newer chunk frame was checked"
    digest = hashlib.sha256(keys[2].encode()).hexdigest()
    record = folder / digest[:2] / f"{digest}.kvr"
    forged = bytearray(record.read_bytes())
    struct.pack_into("<HH", forged, 4, 9, 128)  # record version 9: no header this kvplug checks
    record.write_bytes(bytes(forged))
    assert verify().returncode == 0  # kept for a later kvplug, as before
    strict = verify("--require-signed")
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert f"1 records' signatures could not be checked (another record version): {digest}" in " ".join(
        strict.stderr.split()
    )
