"""The inspection commands (``kvplug store stats|ls|verify``, ``kvplug explain``) on disk
folders: a folder that is not a kvplug store is refused before anything in it is touched,
and a store is inspected without creating, changing or deleting anything in it.

Each command runs in-process through the real CLI app, and the folder's whole tree (names,
kinds, sizes, modes, mtimes and ctimes; atimes aside, which reading sets) is compared
before and after it.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, TierContext, key_digest, load_config
from kvplug.cli.main import app
from kvplug.errors import TierUnavailableError
from kvplug.testing import key_for, value_for
from kvplug_disk import DiskTier, DiskTierConfig, verify_folder
from kvplug_disk.folder_scan import HOST_TAG
from kvplug_disk.ledger import LEDGER_NAME
from kvplug_disk.location import STORE_MARKER

VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
LAYOUT = KVLayout(VLLM_FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
TOKENS = list(range(500, 532))  # two chunks of 16
DAY_AGO_NS = time.time_ns() - 86400 * 10**9
#: A temp file a killed writer on this host left: a writable open removes it at once (its pid is gone).
DEAD_WRITER_TEMP = f"{'ab' * 32}.{HOST_TAG}.999999999.1.deadbeef.tmp"

Tree = dict[str, tuple[str, int, int, int, int]]


def tree(root: Path) -> Tree:
    """Every entry under ``root`` and ``root`` itself: kind, size, mode, mtime and ctime (ns)."""
    found: Tree = {}
    for path in [root, *root.rglob("*")]:
        info = os.lstat(path)
        kind = "folder" if stat.S_ISDIR(info.st_mode) else "file" if stat.S_ISREG(info.st_mode) else "other"
        size = 0 if kind == "folder" else info.st_size  # a folder's size is the file system's business
        found[str(path.relative_to(root))] = (
            kind,
            size,
            stat.S_IMODE(info.st_mode),
            info.st_mtime_ns,
            info.st_ctime_ns,
        )
    return found


def config_file(tmp_path: Path, folder: Path) -> Path:
    path = tmp_path / "kvplug.yaml"
    path.write_text(f"chunk_size: 16\ntiers:\n  - {{type: cpu}}\n  - {{type: disk, path: {folder}}}\n")
    return path


def write_store(folder: Path) -> str:
    """A store written by an engine through tier disk; the engine's fingerprint digest."""
    config = load_config(
        engine_extra={
            "kvplug": {
                "chunk_size": 16,
                "store": {"queue": {"mode": "sync"}},
                "tiers": [{"type": "disk", "path": str(folder)}],
            }
        },
        env={},
    ).config
    caches = [torch.randn(2, 16, 4, 2, 8).to(torch.bfloat16) for _ in range(LAYOUT.num_layers)]
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")) as engine:
        assert engine.store(TOKENS, caches, torch.arange(len(TOKENS))) == len(TOKENS)
        engine.flush()
        return engine.fingerprint.hexdigest()


def what_a_writer_would_change(folder: Path) -> None:
    """Leave what a writable open changes: a stale temp file it would remove, a missing shard
    folder it would make, a folder mode it would make private, a date it would set on a read."""
    (folder / "ab" / DEAD_WRITER_TEMP).write_bytes(b"half a record")
    os.utime(folder / "ab" / DEAD_WRITER_TEMP, ns=(DAY_AGO_NS, DAY_AGO_NS))
    (folder / "cd").rmdir()
    for record in folder.glob("*/*.kvr"):
        os.utime(record, ns=(DAY_AGO_NS, DAY_AGO_NS))
    folder.chmod(0o755)


def commands(folder: Path, settings: Path, fingerprint: str, prompt: Path) -> dict[str, list[str]]:
    return {
        "stats": ["store", "stats", str(folder)],
        "ls": ["store", "ls", str(folder)],
        "verify": ["store", "verify", str(folder)],
        "explain --list-fingerprints": ["explain", "-f", str(settings), "--list-fingerprints"],
        "explain": ["explain", "-f", str(settings), "--fingerprint", fingerprint, str(prompt)],
    }


def run(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(app, args, env={"COLUMNS": "250"})
    assert result.exception is None or isinstance(result.exception, SystemExit), (args, result.exception)
    return result.exit_code, " ".join((result.stdout + result.stderr).split())


@pytest.mark.parametrize("where", ["shard folder", "top"])
def test_a_folder_that_is_not_a_store_is_refused_and_left_exactly_as_it_was(tmp_path: Path, where: str) -> None:
    """A user's folder with one two-hex-digit subfolder and stale ``*.tmp`` files: every
    inspection command refuses it, naming it and why, and creates, changes and deletes nothing
    (opened as a tier, it got 255 shard folders, a ledger, mode 0700, and lost its .tmp files)."""
    folder = tmp_path / "mine"
    (folder / "ab").mkdir(parents=True)
    for temp in (folder / "ab" / "x.tmp", folder / "ab" / DEAD_WRITER_TEMP, folder / "x.tmp"):
        if where == "top" or temp.parent.name == "ab":
            temp.write_text("the user's own file")
            os.utime(temp, ns=(DAY_AGO_NS, DAY_AGO_NS))
    folder.chmod(0o755)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, TOKENS)))
    settings = config_file(tmp_path, folder)
    for name, args in commands(folder, settings, "0" * 64, prompt).items():
        before = tree(folder)
        code, output = run(args)
        assert code != 0, (name, output)
        assert f"not a kvplug store: {folder}" in output and "nothing was created or changed" in output, (name, output)
        assert ("it holds x.tmp" if where == "top" else f"it has no {LEDGER_NAME} ledger") in output, output
        assert tree(folder) == before, name


@pytest.mark.parametrize("marked", [True, False], ids=["marked store", "store of an earlier kvplug"])
def test_every_inspection_command_works_on_a_store_and_changes_nothing(tmp_path: Path, marked: bool) -> None:
    folder = tmp_path / "cache"
    fingerprint = write_store(folder)
    assert (folder / STORE_MARKER).is_file()  # the disk tier marks the folders it writes
    if not marked:  # as a kvplug before the marker left it: the ledger and shard folders only
        (folder / STORE_MARKER).unlink()
    what_a_writer_would_change(folder)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, TOKENS)))
    settings = config_file(tmp_path, folder)
    outputs = {}
    for name, args in commands(folder, settings, fingerprint, prompt).items():
        before = tree(folder)
        code, outputs[name] = run(args)
        assert code == 0, (name, outputs[name])
        assert tree(folder) == before, name
    assert "│ records │ 3 │" in outputs["stats"] and "temps_removed │ 0" in outputs["stats"], outputs["stats"]
    assert "3 records in" in outputs["ls"] and outputs["ls"].count("bfloat16 [2, 2, 16, 16]") == 2
    assert "│ ok │ 3 │" in outputs["verify"] and "│ corrupt │ 0 │" in outputs["verify"], outputs["verify"]
    assert fingerprint in outputs["explain --list-fingerprints"]
    assert "hit: 32 of 32 tokens (2 chunks)" in outputs["explain"], outputs["explain"]
    assert not (folder / STORE_MARKER).exists() or marked


def test_a_tier_opened_read_only_writes_and_removes_nothing(tmp_path: Path) -> None:
    """Asked to write or remove anyway (a read-only tier is an inspection's), the tier refuses:
    a dropped put, a failed removal; a corrupt record it reads is a miss and stays."""
    folder = tmp_path / "cache"
    writer = DiskTier(DiskTierConfig(path=folder), TierContext())
    writer.put([(key_for("a"), value_for("a", 1000)), (key_for("b"), value_for("b", 1000))])
    writer.close()
    digest = key_digest(key_for("b")).hex()
    damaged = folder / digest[:2] / f"{digest}.kvr"
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    before = tree(folder)
    tier = DiskTier(DiskTierConfig(path=folder), TierContext(read_only=True))
    try:
        tier.put([(key_for("c"), value_for("c", 1000))])
        assert tier.stats().extra["dropped_puts"] == 1
        with pytest.raises(TierUnavailableError, match="1 of 1 removals"):
            tier.remove([key_for("a")])
        assert bytes(tier.get([key_for("a")])[0]) == value_for("a", 1000)
        assert tier.get([key_for("b")]) == [None] and tier.stats().extra["corrupt"] == 1
    finally:
        tier.close()
    assert tree(folder) == before


@pytest.mark.parametrize(
    ("extra", "accepted"),
    [
        (None, True),
        ("lost+found/", True),
        ("notes.txt", False),
        ("src/", False),
        ("no ledger", False),
    ],
)
def test_a_store_without_the_marker_is_recognised_by_its_ledger_and_shard_folders_only(
    tmp_path: Path, extra: str | None, accepted: bool
) -> None:
    """Stores written before the marker hold the ledger and shard folders 00..ff and nothing
    else (``lost+found`` aside: a store at the root of its own file system)."""
    folder = tmp_path / "cache"
    tier = DiskTier(DiskTierConfig(path=folder), TierContext())
    tier.put([(key_for("a"), value_for("a", 1000))])
    tier.close()
    (folder / STORE_MARKER).unlink()
    if extra == "no ledger":
        (folder / LEDGER_NAME).unlink()
    elif extra is not None and extra.endswith("/"):
        (folder / extra).mkdir()
    elif extra is not None:
        (folder / extra).write_text("mine")
    before = tree(folder)
    code, output = run(["store", "stats", str(folder)])
    assert (code == 0) is accepted, output
    assert accepted or f"not a kvplug store: {folder}" in output
    assert tree(folder) == before
    if accepted:  # an engine (a writable open) marks it
        DiskTier(DiskTierConfig(path=folder), TierContext()).close()
        assert (folder / STORE_MARKER).is_file()


def as_user(uid: int, gid: int, work: Callable[[], tuple[int, str, int]]) -> tuple[int, str, int]:
    """``work()`` in a forked child that runs as ``uid``/``gid`` (the modules it needs are
    imported already: another user may not read this interpreter's own files)."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(reader)
        with os.fdopen(writer, "w") as out:
            try:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                json.dump(work(), out)
            except BaseException:
                out.write(traceback.format_exc())
            finally:
                out.flush()
                os._exit(0)
    os.close(writer)
    with os.fdopen(reader) as got:
        answer = got.read()
    os.waitpid(pid, 0)
    try:
        code, output, unreadable = json.loads(answer)
    except ValueError:
        raise AssertionError(f"the child as uid {uid} failed: {answer}") from None
    return code, output, unreadable


def test_verify_fails_on_a_record_it_cannot_read_and_counts_it_apart_from_gone() -> None:
    """A record this process may not read (mode 000) is ``unreadable``: verify exits 1 and
    says which, never "gone". As root (who reads any file) the verify runs in a child as
    ``nobody``, over a store given to ``nobody``."""
    root = Path(tempfile.mkdtemp(prefix="kvplug-unreadable-"))  # under /tmp: another user can reach it
    try:
        folder = root / "cache"
        tier = DiskTier(DiskTierConfig(path=folder), TierContext())
        keys = [key_for(f"u{i}") for i in range(3)]
        tier.put([(key, value_for(key, 1000)) for key in keys])
        tier.close()
        digest = key_digest(keys[0]).hex()
        hidden = folder / digest[:2] / f"{digest}.kvr"

        def verify() -> tuple[int, str, int]:
            code, output = run(["store", "verify", str(folder)])
            return code, output, verify_folder(folder).unreadable

        assert verify()[0] == 0  # whole and readable (and what the child needs is imported)
        if os.geteuid() == 0:
            try:
                nobody = pwd.getpwnam("nobody")
            except KeyError:
                pytest.skip("running as root, and there is no user 'nobody' to verify as")
            for path in [root, *root.rglob("*")]:
                os.chown(path, nobody.pw_uid, nobody.pw_gid, follow_symlinks=False)
            hidden.chmod(0)
            code, output, unreadable = as_user(nobody.pw_uid, nobody.pw_gid, verify)
        else:
            hidden.chmod(0)
            if os.access(hidden, os.R_OK):
                pytest.skip("this process reads files of mode 000 (a capability such as CAP_DAC_OVERRIDE)")
            code, output, unreadable = verify()
        assert code == 1, output
        assert f"unreadable: {digest}" in output and "Permission denied" in output, output
        assert "│ ok │ 2 │" in output and "│ unreadable │ 1 │" in output and "│ gone │ 0 │" in output, output
        assert unreadable == 1  # verify_folder, the library's verify, counts it too
    finally:
        for path in [root, *root.rglob("*")]:
            path.chmod(0o700)
        shutil.rmtree(root)
