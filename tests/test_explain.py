"""``kvplug explain`` on stores written by real engines with deliberately different fingerprints."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, DictRecordBackend, random_caches
from typer.testing import CliRunner

from kvplug import (
    CacheEngine,
    Fingerprint,
    KVLayout,
    RecordBackend,
    RecordTier,
    RecordTierConfig,
    RequestInfo,
    TierContext,
    load_config,
)
from kvplug.cli.explain import open_tiers
from kvplug.cli.main import app
from kvplug.core.config.model import KVPlugConfig
from kvplug.core.control.explain import Explanation, explain_prompt
from kvplug.core.records.manifest import KeyScheme, encode_manifest

READER = LAYOUTS["vllm_flash"]  # float16, block 4
TOKENS = list(range(100, 140))  # five chunks of 8


def config_for(tiers: list[dict[str, Any]]) -> KVPlugConfig:
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    return load_config(engine_extra=extra, env={}).config


def engine(config: KVPlugConfig, layout: KVLayout = READER, **fields: Any) -> CacheEngine:
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m", **fields))


def store(config: KVPlugConfig, layout: KVLayout, tokens: list[int], salt: str | None = None, **fields: Any) -> None:
    with engine(config, layout, **fields) as writer:
        writer.store(tokens, random_caches(layout, 80), torch.arange(len(tokens)), request=RequestInfo(cache_salt=salt))
        writer.flush()


def explain_and_look_up(config: KVPlugConfig, salt: str | None = None, **fields: Any) -> tuple[Explanation, int]:
    """What explain says of TOKENS for the reading engine, and what that engine's own lookup says."""
    with engine(config, **fields) as reader:
        scheme = KeyScheme.of(reader.fingerprint.for_request(cache_salt=salt), config.chunk_size, config.hash)
    chain, tiers, _ = open_tiers(config)
    try:
        found = explain_prompt(tiers, scheme, TOKENS)
    finally:
        chain.close()
    with engine(config, **fields) as reader:  # a fresh engine: its memory tiers are empty, like explain's view
        return found, reader.lookup(TOKENS, request=RequestInfo(cache_salt=salt))


#: (case, the writer's layout, its fingerprint fields and salt, the field explain must name)
CASES = {
    "dtype": (dataclasses.replace(READER, dtype=torch.bfloat16), {}, None, "dtype"),
    "block size": (dataclasses.replace(READER, block_size=8), {}, None, "block size"),
    "salt": (READER, {}, "tenant-a", "cache_salt"),
    "tp size": (READER, {"tp_size": 2}, None, "TP size"),
}


def check_names_the_difference(config: KVPlugConfig, case: str, own_prefix: bool) -> None:
    layout, fields, salt, field = CASES[case]
    store(config, layout, TOKENS, salt, **fields)
    if own_prefix:  # the reader itself stored the first two chunks: it hits those, then misses
        store(config, READER, TOKENS[:16], "tenant-b" if case == "salt" else None)
    found, engine_hit = explain_and_look_up(config, "tenant-b" if case == "salt" else None)

    assert found.hit_tokens == engine_hit == (16 if own_prefix else 0)
    assert found.first_missing is not None and found.first_missing.index == found.hit_chunks
    assert [row.tiers for row in found.chunks[found.hit_chunks :]] == [()] * (5 - found.hit_chunks)
    assert len(found.others) == 1 and found.others[0].hit_tokens == 40
    differs = found.others[0].differs
    assert field in differs and field in found.reason, (differs, found.reason)
    if case in ("salt", "tp size"):
        assert differs == (field,)  # nothing else differs
    else:  # the layout text names dtype and block size too
        assert differs == (field, "KV layout")
    assert "not stored under this fingerprint" in found.reason


@pytest.mark.parametrize("own_prefix", [False, True], ids=["all-miss", "partial-hit"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_explain_names_the_field_that_differs_on_disk(tmp_path: Path, case: str, own_prefix: bool) -> None:
    check_names_the_difference(config_for([{"type": "cpu"}, {"type": "disk", "path": str(tmp_path)}]), case, own_prefix)


@pytest.fixture(scope="module")
def valkey_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from kvplug_valkey.testing import ValkeyServer

    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server.url


@pytest.mark.parametrize("case", sorted(CASES))
def test_explain_names_the_field_that_differs_on_valkey(valkey_url: str, case: str) -> None:
    prefix = f"explain-{case.replace(' ', '-')}:"
    tiers = [{"type": "valkey", "url": valkey_url, "key_prefix": prefix, "queue": {"mode": "sync"}}]
    check_names_the_difference(config_for(tiers), case, own_prefix=True)


def test_a_tier_that_cannot_list_checks_the_fingerprints_it_is_given() -> None:
    """Like mooncake: no listing, so no manifests found; a fingerprint given as a candidate is checked."""
    config = config_for([{"type": "cpu"}])
    with engine(config, tp_size=2) as writer, engine(config) as reader:
        writer.store(TOKENS, random_caches(READER, 80), torch.arange(40))
        tiers = [("0:cpu", writer.chain.tiers[0])]  # the writer's own memory tier: it holds the chunks
        ours = KeyScheme.of(reader.fingerprint, 8, "sha256")
        theirs = KeyScheme.of(writer.fingerprint, 8, "sha256")

        blind = explain_prompt(tiers, ours, TOKENS)
        assert blind.hit_tokens == 0 and not blind.others
        assert "cannot list" in blind.notes["0:cpu"]
        assert "no engine with this fingerprint has written" in blind.reason

        told = explain_prompt(tiers, ours, TOKENS, candidates=[theirs])
        assert [(o.differs, o.hit_tokens) for o in told.others] == [(("TP size",), 40)]
        assert "TP size" in told.reason


class UnlistedTier(RecordTier):
    name = "unlisted"
    Config = RecordTierConfig

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        return DictRecordBackend()  # no listing: a store like Mooncake's


def test_a_record_tier_that_cannot_list_is_told_and_checks_given_fingerprints() -> None:
    config = RecordTierConfig.model_validate({"scan_on_start": False})
    tier = UnlistedTier(config, TierContext(logger=logging.getLogger("test.explain")))
    ours = KeyScheme.of(Fingerprint(model_id="m", kv_layout="l", dtype="float16", block_size=4), 8, "sha256")
    theirs = KeyScheme.of(
        Fingerprint(model_id="m", kv_layout="l", dtype="float16", block_size=4, tp_size=8), 8, "sha256"
    )
    try:
        tier.put([(k.key, b"chunk") for k in theirs.key_builder().keys(TOKENS, theirs.prefix)])
        tier.put([(theirs.manifest_key(), encode_manifest(theirs))])
        blind = explain_prompt([("0:unlisted", tier)], ours, TOKENS)
        assert blind.notes["0:unlisted"].startswith("cannot list its records") and not blind.others
        told = explain_prompt([("0:unlisted", tier)], ours, TOKENS, candidates=[theirs])
        assert [(o.differs, o.hit_tokens) for o in told.others] == [(("TP size",), 40)]
    finally:
        tier.close()


def test_partial_chunks_evictions_and_whole_hits_are_told_apart(tmp_path: Path) -> None:
    config = config_for([{"type": "disk", "path": str(tmp_path)}])
    store(config, READER, TOKENS)
    found, hit = explain_and_look_up(config)
    assert found.hit_tokens == hit == 40 and found.reason == "the whole prompt is cached"

    with engine(config) as reader:
        scheme = KeyScheme.of(reader.fingerprint, 8, "sha256")
        reader.chain.discard([reader.chunk_keys(TOKENS)[1].key])  # as if evicted
    chain, tiers, _ = open_tiers(config)
    try:
        evicted = explain_prompt(tiers, scheme, TOKENS)
        partial = explain_prompt(tiers, scheme, [*TOKENS[:8], 1, 2, 3])
    finally:
        chain.close()
    assert evicted.hit_tokens == 8 and "later chunks are held" in evicted.reason
    assert partial.hit_tokens == 8 and "partial chunk (3 of 8 tokens)" in partial.reason


def test_explain_reads_no_record_larger_than_a_manifest(tmp_path: Path) -> None:
    """explain reads only manifests: its tiers read no record past a manifest's size, so a
    record that a listing showed small and that is large when read is never held whole."""
    from kvplug.core.control.explain import list_manifests
    from kvplug.core.records.frame import RECORD_HEADER_SIZE
    from kvplug.core.records.manifest import MANIFEST_MAX_BYTES
    from kvplug.errors import CorruptChunkError

    config = config_for([{"type": "disk", "path": str(tmp_path)}])
    store(config, READER, TOKENS)
    with engine(config) as writer:
        writer.chain.tiers[0].put([("v1/planted/00", bytes(1 << 20))])
        ours = writer.fingerprint.hexdigest()
    chain, tiers, _ = open_tiers(config)
    try:
        (label, tier), notes = tiers[0], {}
        assert [s.fingerprint_hex for s in list_manifests(label, tier, notes)] == [ours] and not notes
        planted = next(r for r in tier.records() if r.size > 1 << 20)
        with pytest.raises(CorruptChunkError, match=f"over the {RECORD_HEADER_SIZE + MANIFEST_MAX_BYTES} bytes"):
            tier.read_record(planted.digest)
    finally:
        chain.close()


def kvplug(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="250")
    env.pop("KVPLUG_PLUGINS", None)
    command = [sys.executable, "-m", "kvplug.cli.main", "explain", *args]
    return subprocess.run(command, env=env, input=stdin, capture_output=True, text=True, timeout=120)


def test_the_command_prints_the_chunk_map_and_json(tmp_path: Path) -> None:
    folder = tmp_path / "cache"
    config = config_for([{"type": "disk", "path": str(folder)}])
    store(config, READER, TOKENS, tp_size=4, tp_rank=1)
    store(config, READER, TOKENS[:16])
    (tmp_path / "kvplug.yaml").write_text(
        f"chunk_size: 8\ntiers:\n  - {{type: cpu}}\n  - {{type: disk, path: {folder}}}\n"
    )
    with engine(config) as reader:
        (tmp_path / "fp.json").write_text(json.dumps(dataclasses.asdict(reader.fingerprint)))
        ours = reader.fingerprint.hexdigest()
    (tmp_path / "prompt.txt").write_text(" ".join(map(str, TOKENS)))
    common = ["-f", str(tmp_path / "kvplug.yaml")]

    listing = kvplug(*common, "--list-fingerprints")
    assert listing.returncode == 0, listing.stderr
    assert ours in listing.stdout and listing.stdout.count("1:disk") == 2
    listed = json.loads(kvplug(*common, "--list-fingerprints", "--json").stdout)["fingerprints"]
    assert sorted((f["fingerprint"] == ours, f["fields"]["tp_size"]) for f in listed) == [(False, 4), (True, 1)]

    shown = kvplug(*common, "--fingerprint", ours[:10], str(tmp_path / "prompt.txt"))
    assert shown.returncode == 0, shown.stderr
    assert "hit: 16 of 40 tokens (2 chunks)" in shown.stdout
    assert "TP rank (0 here, 1 there); TP size (1 here, 4 there)" in shown.stdout
    assert "tier 0:cpu: in memory" in shown.stdout

    as_json = kvplug(*common, "--fingerprint", str(tmp_path / "fp.json"), "--json", "-", stdin=json.dumps(TOKENS))
    assert as_json.returncode == 0, as_json.stderr
    report = json.loads(as_json.stdout)
    assert (report["hit_tokens"], report["first_missing_chunk"]) == (16, 2)
    assert [c["tiers"] for c in report["chunks"]] == [["1:disk"], ["1:disk"], [], [], []]
    assert report["other_fingerprints"][0]["differs"] == ["TP rank", "TP size"]

    salted = kvplug(*common, "--fingerprint", ours, "--cache-salt", "x", "--json", str(tmp_path / "prompt.txt"))
    assert json.loads(salted.stdout)["hit_tokens"] == 0


@pytest.mark.parametrize(
    ("prompt", "args", "message"),
    [
        ("hello world", [], "is not token ids"),
        ("[1, 2.5]", [], "must be a list of integers"),
        ("[" * 100_000, [], "nests too deeply"),
        ("1 2 3", ["--tokenizer", "gpt2"], "needs the transformers package"),
        ("1 2 3", ["--set", "colour=blue"], "not a fingerprint field"),
        ("1 2 3", ["--set", "tp_size=two"], "tp_size must be an integer"),
        ("1 2 3", [], "no fingerprint manifests in the tiers match"),
    ],
)
def test_bad_input_is_a_clear_error(tmp_path: Path, prompt: str, args: list[str], message: str) -> None:
    (tmp_path / "kvplug.yaml").write_text(f"chunk_size: 8\ntiers:\n  - {{type: disk, path: {tmp_path / 'c'}}}\n")
    with engine(config_for([{"type": "disk", "path": str(tmp_path / "c")}])):
        pass  # an empty store, as an engine leaves it (explain refuses a folder that is not one)
    (tmp_path / "p.txt").write_text(prompt)
    fingerprint = ["--fingerprint", "abc"]
    if "--set" in args:
        (tmp_path / "fp.json").write_text(
            json.dumps({"model_id": "m", "kv_layout": "l", "dtype": "f", "block_size": 4})
        )
        fingerprint = ["--fingerprint", str(tmp_path / "fp.json")]
    args = ["explain", "-f", str(tmp_path / "kvplug.yaml"), *fingerprint, *args, str(tmp_path / "p.txt")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.stderr, result.stderr


def test_a_fingerprint_file_nested_too_deeply_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "kvplug.yaml").write_text(f"chunk_size: 8\ntiers:\n  - {{type: disk, path: {tmp_path / 'c'}}}\n")
    with engine(config_for([{"type": "disk", "path": str(tmp_path / "c")}])):
        pass
    (tmp_path / "fp.json").write_text("[" * 100_000)
    (tmp_path / "p.txt").write_text("1 2 3")
    args = ["explain", "-f", str(tmp_path / "kvplug.yaml"), "--fingerprint", str(tmp_path / "fp.json")]
    result = CliRunner().invoke(app, [*args, str(tmp_path / "p.txt")])
    assert result.exit_code == 2 and "nests too deeply" in result.stderr, result.stderr


def test_a_disk_tier_whose_folder_is_not_a_store_is_an_error_and_nothing_is_created(tmp_path: Path) -> None:
    """explain opens its tiers read-only: a folder no engine wrote is refused, not made a store."""
    (tmp_path / "kvplug.yaml").write_text(f"chunk_size: 8\ntiers:\n  - {{type: disk, path: {tmp_path / 'c'}}}\n")
    result = CliRunner().invoke(app, ["explain", "-f", str(tmp_path / "kvplug.yaml"), "--list-fingerprints"])
    assert result.exit_code == 2, result.stderr
    assert f"not a kvplug store: {tmp_path / 'c'} does not exist" in " ".join(result.stderr.split())
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("command", ["explain", "ctl lookup"])
def test_a_prompt_file_that_is_not_utf8_is_a_clear_error(tmp_path: Path, command: str) -> None:
    """A binary file (or text in another encoding) given as the prompt is an error naming
    the file and the byte, exit 2, not a traceback; ``kvplug ctl`` reads prompts the same way."""
    (tmp_path / "kvplug.yaml").write_text(f"chunk_size: 8\ntiers:\n  - {{type: disk, path: {tmp_path / 'c'}}}\n")
    with engine(config_for([{"type": "disk", "path": str(tmp_path / "c")}])):
        pass
    (tmp_path / "p.bin").write_bytes(b"1 2 \xff\xfe 3")
    args = {
        "explain": ["explain", "-f", str(tmp_path / "kvplug.yaml"), "--fingerprint", "abc"],
        "ctl lookup": ["ctl", "lookup", "--socket-dir", str(tmp_path / "sockets")],
    }[command]
    result = CliRunner().invoke(app, [*args, str(tmp_path / "p.bin")])
    assert result.exit_code == 2 and "is not UTF-8 text: byte 4 is b'\\xff'" in result.stderr, result.output


def test_a_fingerprint_file_that_never_ends_is_refused_at_its_bound(tmp_path: Path) -> None:
    """A ``--candidate`` file larger than any fingerprint (a wrong file, ``/dev/zero``) is read
    only to a bound past any fingerprint, then refused naming it: never read whole."""
    from kvplug.cli.explain import FINGERPRINT_FILE_MAX_BYTES

    (tmp_path / "kvplug.yaml").write_text(f"chunk_size: 8\ntiers:\n  - {{type: disk, path: {tmp_path / 'c'}}}\n")
    with engine(config_for([{"type": "disk", "path": str(tmp_path / "c")}])) as writer:
        fingerprint = dataclasses.asdict(writer.fingerprint)
    (tmp_path / "fp.json").write_text(json.dumps(fingerprint))
    (tmp_path / "p.txt").write_text("1 2 3")
    args = ["explain", "-f", str(tmp_path / "kvplug.yaml"), "--fingerprint", str(tmp_path / "fp.json")]
    # (a regular file: the command before the bound would read /dev/zero until memory ran out)
    huge = tmp_path / "huge.json"
    huge.write_text(json.dumps({**fingerprint, "pad": " " * FINGERPRINT_FILE_MAX_BYTES}))
    result = CliRunner().invoke(app, [*args, "--candidate", str(huge), str(tmp_path / "p.txt")])
    assert result.exit_code == 2, result.output
    assert f"{str(huge)!r} is over {FINGERPRINT_FILE_MAX_BYTES} bytes" in result.stderr, result.stderr


@pytest.mark.parametrize("command", ["explain", "ctl lookup"])
def test_a_prompt_file_past_any_prompt_is_refused_at_its_bound(tmp_path: Path, command: str) -> None:
    """A prompt file larger than the token ids of any prompt (a wrong file, ``/dev/zero``) is read
    only to a bound, then refused naming it (exit 2): never read whole."""
    from kvplug.cli.prompt import PROMPT_MAX_BYTES

    (tmp_path / "kvplug.yaml").write_text(f"chunk_size: 8\ntiers:\n  - {{type: disk, path: {tmp_path / 'c'}}}\n")
    with engine(config_for([{"type": "disk", "path": str(tmp_path / "c")}])):
        pass
    # (a regular file: the command before the bound would read /dev/zero until memory ran out)
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as file:
        file.truncate(PROMPT_MAX_BYTES + 1)  # NUL bytes, sparse: the bound is not about the disk
    args = {
        "explain": ["explain", "-f", str(tmp_path / "kvplug.yaml"), "--fingerprint", "abc"],
        "ctl lookup": ["ctl", "lookup", "--socket-dir", str(tmp_path / "sockets")],
    }[command]
    result = CliRunner().invoke(app, [*args, str(huge)])
    assert result.exit_code == 2, result.output
    assert f"{str(huge)!r} is over {PROMPT_MAX_BYTES} bytes" in " ".join(result.stderr.split()), result.stderr
