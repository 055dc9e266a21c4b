"""A LoRA adapter kvplug can read is keyed by its content, not its path: files rewritten at
the same path (an RL or fine-tuning loop reloading its adapter) never hit the old KV."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvplug import ExtraKey
from kvplug.testing import write_lora_adapter
from kvplug.testing.adapters import date_back


def path_key(source: str) -> ExtraKey:
    return ExtraKey(0, 1, "adapter_source:" + hashlib.sha256(source.encode()).hexdigest())


def test_an_adapter_rewritten_at_its_path_is_another_key(tmp_path: Path) -> None:
    adapter = write_lora_adapter(tmp_path / "sql", b"weights of step 1")
    before = ExtraKey.adapter_source(str(adapter))
    assert before != path_key(str(adapter)), "a readable adapter is keyed by its path"
    assert ExtraKey.adapter_source(str(adapter)) == before

    write_lora_adapter(adapter, b"weights of step 2")  # same size, same names, same path
    assert ExtraKey.adapter_source(str(adapter)) != before, "the rewritten adapter got the old adapter's key"


def test_a_rewrite_that_keeps_size_and_restores_mtime_is_still_seen(tmp_path: Path) -> None:
    """In-place writes keep the inode; a copy tool may restore the mtime: ctime still moves."""
    adapter = write_lora_adapter(tmp_path / "sql", b"A" * 64)
    before = ExtraKey.adapter_source(str(adapter))
    weights = adapter / "adapter_model.safetensors"
    st = weights.stat()
    with open(weights, "r+b") as f:
        f.write(b"B" * 64)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert ExtraKey.adapter_source(str(adapter)) != before


def test_a_file_added_or_a_config_changed_is_another_key(tmp_path: Path) -> None:
    adapter = write_lora_adapter(tmp_path / "sql", b"weights")
    before = ExtraKey.adapter_source(str(adapter))
    write_lora_adapter(adapter, b"weights", rank=16)
    after_config = ExtraKey.adapter_source(str(adapter))
    assert after_config != before
    (adapter / "new_embeddings.safetensors").write_bytes(b"embeddings")
    assert ExtraKey.adapter_source(str(adapter)) not in (before, after_config)


def test_the_same_files_at_any_path_are_the_same_key(tmp_path: Path) -> None:
    """Two servers with identical adapter files in other folders share their chunks."""
    one = write_lora_adapter(tmp_path / "server-1" / "sql", b"weights")
    other = shutil.copytree(one, tmp_path / "server-2" / "adapters" / "sql-copy")
    assert ExtraKey.adapter_source(str(one)) == ExtraKey.adapter_source(str(other))
    single = tmp_path / "adapter.safetensors"
    single.write_bytes(b"weights")
    copy = shutil.copy(single, tmp_path / "server-2" / "other-name.safetensors")
    assert ExtraKey.adapter_source(str(single)) == ExtraKey.adapter_source(str(copy)) != path_key(str(single))


@pytest.mark.parametrize("source", ["org/sql-lora", "s3://bucket/adapters/sql", "/no/such/adapter", ""])
def test_a_source_kvplug_cannot_read_keeps_its_path_key(source: str) -> None:
    assert ExtraKey.adapter_source(source) == path_key(source)


def key_as_nobody(source: str) -> str:
    """The adapter's extra key as a process of the unprivileged user ``nobody`` computes it (a
    fork of this one: no interpreter or venv it may not open)."""
    read, write = os.pipe()
    child = os.fork()
    if child == 0:  # (the child: never back into pytest)
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, ExtraKey.adapter_source(source).value.encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as answer:
        value = answer.read()
    os.waitpid(child, 0)
    return value


def test_an_unreadable_adapter_keeps_its_path_key(tmp_path: Path) -> None:
    # A file this process may not read (mode 0; as root, CI's user, the key is computed by a
    # process of the user ``nobody``, for whom the folders are open and the file is not).
    shared = Path(tempfile.mkdtemp(prefix="kvplug-adapter-"))
    try:
        shared.chmod(0o755)
        adapter = write_lora_adapter(shared / "sql", b"weights")
        adapter.chmod(0o755)
        (adapter / "adapter_config.json").chmod(0o644)
        (adapter / "adapter_model.safetensors").chmod(0)
        source = str(adapter)
        key = key_as_nobody(source) if os.geteuid() == 0 else ExtraKey.adapter_source(source).value
        assert key == path_key(source).value
        (adapter / "adapter_model.safetensors").chmod(0o644)  # and readable, its content's key
        readable = key_as_nobody(source) if os.geteuid() == 0 else ExtraKey.adapter_source(source).value
        assert readable.startswith("adapter_content:"), readable
    finally:
        shutil.rmtree(shared)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert ExtraKey.adapter_source(str(empty)) == path_key(str(empty))


def test_a_kept_digest_is_not_read_again_until_a_file_changes(tmp_path: Path) -> None:
    from kvplug.core.adapter_digest import AdapterDigests

    digests = AdapterDigests()
    adapter = write_lora_adapter(tmp_path / "sql", b"weights")
    first = digests.digest(str(adapter))
    assert digests.files_read == 2
    for _ in range(5):
        assert digests.digest(str(adapter)) == first
    assert digests.files_read == 2, "a request re-read an adapter whose files did not change"
    write_lora_adapter(adapter, b"retrained")
    assert digests.digest(str(adapter)) not in (None, first)
    assert digests.files_read == 4


def test_a_just_written_adapter_is_hashed_again_rather_than_trusted_by_its_stat(tmp_path: Path) -> None:
    """A write within the same timestamp tick could keep the stat signature: a digest of
    files this fresh is not kept, so the next request reads them again."""
    from kvplug.core.adapter_digest import AdapterDigests

    digests = AdapterDigests()
    adapter = tmp_path / "sql"
    adapter.mkdir()
    (adapter / "adapter_model.safetensors").write_bytes(b"weights")
    first = digests.digest(str(adapter))
    assert digests.digest(str(adapter)) == first
    assert digests.files_read == 2


def test_a_file_whose_name_is_not_utf8_is_hashed_by_its_bytes(tmp_path: Path) -> None:
    """A name the filesystem holds as arbitrary bytes comes back surrogate-escaped: hashing it
    must not raise on the engine's scheduler."""
    adapter = write_lora_adapter(tmp_path / "sql", b"weights")
    os.close(os.open(os.path.join(os.fsencode(adapter), b"notes-\xff.txt"), os.O_CREAT | os.O_WRONLY, 0o644))
    date_back(adapter)
    assert ExtraKey.adapter_source(str(adapter)).value.startswith("adapter_content:")


def test_pins_and_ctl_key_a_readable_adapter_by_its_content_as_the_engine_does(tmp_path: Path) -> None:
    """A pin's ``lora_path`` and ``kvplug ctl --lora-path`` read the same files the engine keys
    (there or in a copy at any path): their keys are the engine's."""
    from kvplug.cli.ctl import _request
    from kvplug.core.tenancy import PinSpec

    adapter = write_lora_adapter(tmp_path / "sql", b"weights")
    copy = shutil.copytree(adapter, tmp_path / "ctl-host" / "sql")
    engine_key = ExtraKey.adapter_source(str(adapter))
    assert engine_key.value.startswith("adapter_content:")
    pin = PinSpec(prefix_file=tmp_path / "prefix.json", lora_id="sql", lora_path=str(adapter))
    assert pin.request().extra_keys == (engine_key,)
    assert _request(None, "sql", str(copy)) == _request(None, "sql", str(adapter))


def test_an_adapter_read_while_it_is_rewritten_gets_a_key_of_its_own_never_the_path_key(tmp_path: Path) -> None:
    """Files that change while kvplug reads them are of neither version, and the engine may have
    loaded either: the path key (which a request during the next rewrite would get too) would let
    two rewrites' requests read each other's KV. Each such read gets a key no other has."""
    from kvplug.core.adapter_digest import AdapterDigests

    adapter = write_lora_adapter(tmp_path / "sql", b"A" * 64)
    weights = adapter / "adapter_model.safetensors"

    class RewrittenWhileRead(AdapterDigests):
        def _hash(self, path, signature):  # type: ignore[no-untyped-def]
            weights.write_bytes(b"B" * 65)  # a real write, between the stat and the read
            return super()._hash(path, signature)

    digests = RewrittenWhileRead()
    first, second = digests.digest(str(adapter)), digests.digest(str(adapter))
    assert first is not None and second is not None, "a rewrite in progress fell back to the path key"
    assert first != second, "two reads of files being rewritten shared a key"
    settled = AdapterDigests().digest(str(adapter))
    assert settled not in (first, second)
