"""Fingerprint manifests: their keys, their bounded format, and how often an engine writes them."""

from __future__ import annotations

import gc
import json

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import Fingerprint
from kvplug.core.records import manifest as manifest
from kvplug.core.records.manifest import MANIFEST_MAGIC, KeyScheme, ManifestWriter, decode_manifest, encode_manifest

BASE = Fingerprint(model_id="m", kv_layout="l", dtype="float16", block_size=16, cache_salt="secret-tenant")


def test_a_manifest_round_trips_without_its_salt() -> None:
    scheme = KeyScheme.of(BASE, 256, "sha256")
    value = encode_manifest(scheme)
    assert b"secret-tenant" not in value and value.startswith(MANIFEST_MAGIC)
    assert decode_manifest(value) == scheme
    assert scheme.prefix == f"v1/{BASE.hexdigest()}/" and scheme.manifest_key().startswith(scheme.prefix)
    # Its name has the shape of a chunk key, and depends on the chunk size and hash.
    assert len(scheme.manifest_key().rsplit("/", 1)[1]) == 64
    assert KeyScheme.of(BASE, 128, "sha256").manifest_key() != scheme.manifest_key()
    same_salt = KeyScheme.of(BASE.for_request(cache_salt="secret-tenant"), 256, "sha256")
    other_salt = KeyScheme.of(BASE.for_request(cache_salt="other"), 256, "sha256")
    assert scheme.differences(same_salt) == [] and scheme.differences(other_salt) == ["cache_salt"]


def test_anything_else_is_not_a_manifest() -> None:
    good = json.loads(encode_manifest(KeyScheme.of(BASE, 8, "sha256"))[len(MANIFEST_MAGIC) :])
    bad_bodies = [
        b"not json",
        json.dumps({"fields": good["fields"]}).encode(),
        json.dumps({**good, "prefix": "no-slashes"}).encode(),
        json.dumps({**good, "prefix": "1/[/x]/"}).encode(),  # not <version>/<hex digest>/: rich markup
        b"[" * 8000 + b"]" * 8000,  # nested past the JSON parser's recursion limit
        json.dumps({**good, "fields": {**good["fields"], "chunk_size": 0}}).encode(),
        json.dumps({**good, "fields": {**good["fields"], "hash": "md5"}}).encode(),
        json.dumps({**good, "fields": {**good["fields"], "model_id": ["a", "list"]}}).encode(),
    ]
    for body in bad_bodies:
        assert decode_manifest(MANIFEST_MAGIC + body) is None, body
    assert decode_manifest(b"KVC1" + bytes(100)) is None  # a chunk frame
    assert decode_manifest(MANIFEST_MAGIC + b" " * manifest.MANIFEST_MAX_BYTES) is None  # too big to be one


def test_an_engine_writes_each_fingerprint_once_a_while_in_bounded_memory(monkeypatch) -> None:
    written: list[str] = []
    now = [0.0]

    class Chain:  # records what the writer puts, and that it bypasses admission
        def put(self, items: list[tuple[str, bytes]], *, admission: bool = True) -> None:
            assert admission is False
            written.extend(k for k, _ in items)

    writer = ManifestWriter(Chain(), 8, "sha256", clock=lambda: now[0])  # type: ignore[arg-type]
    salted = [BASE.for_request(cache_salt=str(i)) for i in range(3)]
    for fingerprint in [*salted, *salted]:
        writer.note(fingerprint)
    assert len(written) == 3  # once per fingerprint
    now[0] = manifest.MANIFEST_REFRESH_S + 1
    writer.note(salted[0])
    assert len(written) == 4  # again after the refresh interval, so an LRU tier keeps it
    monkeypatch.setattr(manifest, "MANIFEST_MEMORY", 2)
    for i in range(10):
        writer.note(BASE.for_request(cache_salt=f"many-{i}"))
    assert len(writer._written) == 2
    huge = Fingerprint(model_id="x" * manifest.MANIFEST_MAX_BYTES, kv_layout="l", dtype="f", block_size=1)
    writer.note(huge)  # over the bound: not written, never an error
    assert len(written) == 14


def test_a_manifest_whose_store_was_dropped_is_due_again() -> None:
    """An engine takes the manifest due with a store (written on its store worker): if the
    store queue drops that store, the manifest was never written and must not wait for the
    refresh interval to be written."""
    writer = ManifestWriter(None, 8, "sha256")  # type: ignore[arg-type]
    due = writer.due(BASE)
    assert [key for key, _ in due] == [KeyScheme.of(BASE, 8, "sha256").manifest_key()]
    assert writer.due(BASE) == []  # handed out once
    writer.forget(due)
    assert writer.due(BASE) == due


def test_explain_shows_store_text_as_it_is_not_as_markup() -> None:
    """A manifest's fields come from a shared store: text like ``[/bold]`` in them must
    print as it is, neither crashing the table (MarkupError) nor styling the output."""
    from rich.console import Console

    from kvplug.cli.prompt import plain as _plain

    console = Console(record=True, width=200)
    from rich.table import Table

    table = Table()
    table.add_column("model")
    table.add_row(*_plain("evil[/bold] [red]forged[/red]"))
    console.print(table)
    assert "evil[/bold] [red]forged[/red]" in console.export_text()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("abandon", ["closed", "collected", "raising", "never started"])
def test_a_layerwise_store_abandoned_before_its_last_layer_leaves_its_manifest_due(
    make_engine, mode: str, abandon: str
) -> None:
    """An engine drops a layer-wise store whose forward did not finish: its manifest was never
    written, so the next store writes it (not the next store after the refresh interval)."""
    layout = LAYOUTS["vllm_flash"]
    engine = make_engine(layout, **{"store.queue.mode": mode})
    caches = random_caches(layout, 8)
    key = KeyScheme.of(engine.fingerprint, engine.chunk_size, engine.config.hash).manifest_key()
    storing = engine.store_layerwise(list(range(16)), caches, torch.arange(16))
    if abandon != "never started":
        assert next(storing) == 0
    if abandon == "raising":
        with pytest.raises(RuntimeError):
            storing.throw(RuntimeError("the forward failed"))
    elif abandon == "collected":
        del storing
        gc.collect()
    else:
        storing.close()
    engine.flush()
    assert engine.chain.contains_any([key]) == [False]  # the abandoned store wrote nothing

    assert engine.store(list(range(100, 116)), caches, torch.arange(16)) == 16
    engine.flush()
    assert engine.chain.contains_any([key]) == [True]
