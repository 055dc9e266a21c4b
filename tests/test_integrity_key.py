"""With an integrity key, a forged or re-framed record is a miss, counted.

Without a key anyone who can write a shared folder or bucket can build a record with valid
checksums; with ``KVPLUG_INTEGRITY_KEY`` every record carries a keyed MAC over its key digest,
header and value, so only holders of the key can write records the cache will serve.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvplug.core.records import frame as record
from kvplug.core.records.store import check_record
from kvplug.errors import ConfigError, CorruptChunkError, IncompatibleChunkError

KEY = "integrity-key-for-tests-0123456789"

#: For each attack: stores prompts A and B through a disk tier, lets a key-less attacker
#: re-frame B's first chunk under A's first key (a v1 record with valid checksums built by
#: hand, or B's own record with A's digest patched in), runs ``kvplug store verify``, then
#: reads A back in a fresh engine. Prints one JSON line per attack.
POISON = textwrap.dedent(
    """
    import hashlib, json, struct, sys, torch, xxhash
    from pathlib import Path
    from typer.testing import CliRunner
    from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config
    from kvplug.cli.main import app

    def unkeyed_record(key, value):  # the documented v1 frame, built by hand as an attacker would
        head = struct.pack("<4sHHQ32sQ", b"KVPR", 1, 64, len(value), hashlib.sha256(key.encode()).digest(),
                           xxhash.xxh3_64_intdigest(value))
        return head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)) + value

    def path(folder, key):
        digest = hashlib.sha256(key.encode()).hexdigest()
        return folder / digest[:2] / (digest + ".kvr")

    flash = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
    layout = KVLayout(flash, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
    fingerprint = Fingerprint.for_layout(layout, model_id="m")
    caches = [torch.randn(2, 32, 4, 2, 8).to(torch.bfloat16) for _ in range(2)]
    a, b = list(range(16)), list(range(1000, 1016))
    root = Path(sys.argv[1])
    for attack in sys.argv[2:]:
        folder = root / attack
        extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}},
                            "tiers": [{"type": "disk", "path": str(folder), "queue": {"mode": "sync"}}]}}
        with CacheEngine(load_config(engine_extra=extra, env={}).config, layout, fingerprint) as engine:
            engine.store(a, caches, torch.arange(16))
            engine.store(b, caches, torch.arange(16, 32))
            engine.flush()
            key_a, key_b = engine.chunk_keys(a)[0].key, engine.chunk_keys(b)[0].key
        stolen = path(folder, key_b).read_bytes()
        if attack == "reframe":
            path(folder, key_a).write_bytes(unkeyed_record(key_a, stolen[64:]))
        else:
            forged = bytearray(stolen)
            forged[16:48] = hashlib.sha256(key_a.encode()).digest()
            path(folder, key_a).write_bytes(bytes(forged))
        verify = CliRunner().invoke(app, ["store", "verify", str(folder)], terminal_width=250)
        with CacheEngine(load_config(engine_extra=extra, env={}).config, layout, fingerprint) as engine:
            loaded = engine.retrieve(a, caches, torch.arange(16))
            stats = engine.chain.stats()[0][1]
        print(json.dumps({"attack": attack, "loaded": int(loaded.sum()), "corrupt": stats.extra.get("corrupt", 0),
                          "verify_exit": verify.exit_code, "verify": verify.output}))
    """
)


def run_poison(tmp_path: Path, attacks: list[str], key: str | None) -> dict[str, dict]:
    env = dict(os.environ)
    env.pop("KVPLUG_PLUGINS", None)
    env.pop("KVPLUG_INTEGRITY_KEY_FILE", None)
    env.pop("KVPLUG_INTEGRITY_KEY", None)
    if key is not None:
        env["KVPLUG_INTEGRITY_KEY"] = key
    result = subprocess.run(
        [sys.executable, "-c", POISON, str(tmp_path), *attacks], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    outcomes = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    return {outcome["attack"]: outcome for outcome in outcomes}


def test_a_forged_record_is_a_counted_miss_with_a_key(tmp_path: Path) -> None:
    outcomes = run_poison(tmp_path, ["reframe", "patch-digest"], KEY)
    assert sorted(outcomes) == ["patch-digest", "reframe"]
    for outcome in outcomes.values():
        assert outcome["loaded"] == 0, outcome  # A's first chunk is forged: nothing of A loads
        assert outcome["corrupt"] >= 1, outcome
        assert outcome["verify_exit"] == 1 and "corrupt:" in outcome["verify"], outcome


def test_without_a_key_a_reframed_record_is_served(tmp_path: Path) -> None:
    """Today's behaviour without a key, as documented: checksums catch accidents, not attackers."""
    outcome = run_poison(tmp_path, ["reframe"], None)["reframe"]
    assert outcome["loaded"] == 16 and outcome["corrupt"] == 0, outcome
    assert outcome["verify_exit"] == 0, outcome


@pytest.fixture
def keyed():
    record.set_integrity_key(KEY.encode())
    yield
    record.set_integrity_key(...)


def test_keyed_records_round_trip_and_bind_key_and_value(keyed: None) -> None:
    data = record.pack_record("k1", b"value" * 10)
    assert bytes(record.unpack_record(data, "k1")) == b"value" * 10
    assert check_record(record.key_digest("k1").hex(), data).status == "ok"
    with pytest.raises(CorruptChunkError):
        record.unpack_record(data, "k2")
    flipped = bytearray(data)
    flipped[-1] ^= 1
    with pytest.raises(CorruptChunkError):
        record.unpack_record(bytes(flipped), "k1")
    record.set_integrity_key(b"another key, same length......")
    with pytest.raises(CorruptChunkError):
        record.unpack_record(data, "k1")


def test_records_across_key_settings(keyed: None) -> None:
    keyed_record = record.pack_record("k", b"v" * 100)
    record.set_integrity_key(None)
    plain = record.pack_record("k", b"v" * 100)
    assert bytes(record.unpack_record(plain, "k")) == b"v" * 100  # no key: today's format, readable
    with pytest.raises(IncompatibleChunkError, match="integrity key"):
        record.unpack_record(keyed_record, "k")  # a keyed record without the key: a miss, never misread
    check = check_record(record.key_digest("k").hex(), keyed_record)
    assert check.status == "unverified"  # kvplug store gc keeps it
    record.set_integrity_key(KEY.encode())
    with pytest.raises(CorruptChunkError, match="no keyed MAC"):
        record.unpack_record(plain, "k")  # with a key, an unkeyed record is untrusted


def test_the_key_comes_from_the_environment_or_a_private_file(tmp_path: Path) -> None:
    secret_file = tmp_path / "key"
    secret_file.write_text(KEY + "\n")
    secret_file.chmod(0o600)
    from_file = record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY_FILE": str(secret_file)})
    assert from_file == record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY": KEY}) is not None
    assert record.resolve_integrity_key({}) is None
    secret_file.chmod(0o644)
    with pytest.raises(ConfigError, match="readable by other users"):
        record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY_FILE": str(secret_file)})
    with pytest.raises(ConfigError, match="at least 16") as info:
        record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY": "short"})
    assert "short" not in str(info.value)
    with pytest.raises(ConfigError, match="not both"):
        record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY": KEY, "KVPLUG_INTEGRITY_KEY_FILE": str(secret_file)})


# --- the key variables' edges ------------------------------------


@pytest.mark.parametrize("name", ["KVPLUG_INTEGRITY_KEY", "KVPLUG_INTEGRITY_KEY_FILE"])
@pytest.mark.parametrize("value", ["", "  ", "\n"])
def test_a_set_but_empty_key_variable_is_an_error_not_no_key(name: str, value: str) -> None:
    """``export KVPLUG_INTEGRITY_KEY="$(cat /run/secrets/missing)"`` sets an empty value: that must not
    turn signing off (unsigned records written, forged ones served)."""
    with pytest.raises(ConfigError) as info:
        record.resolve_integrity_key({name: value})
    assert [p.path for p in info.value.problems] == [f"env {name}"]
    assert "set but empty" in str(info.value) and "unset the variable" in str(info.value)
    assert record.resolve_integrity_key({}) is None  # unset is still "no key"


def test_an_empty_variable_beside_a_good_key_is_still_an_error(tmp_path: Path) -> None:
    secret_file = tmp_path / "key"
    secret_file.write_text(KEY)
    secret_file.chmod(0o600)
    with pytest.raises(ConfigError, match="KVPLUG_INTEGRITY_KEY_FILE: is set but empty"):
        record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY": KEY, "KVPLUG_INTEGRITY_KEY_FILE": ""})
    with pytest.raises(ConfigError, match="KVPLUG_INTEGRITY_KEY: is set but empty"):
        record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY": "", "KVPLUG_INTEGRITY_KEY_FILE": str(secret_file)})


def kvplug_cli(*args: str, env_update: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUG_")}
    env.update(env_update, COLUMNS="250")
    return subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", *args], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("name", ["KVPLUG_INTEGRITY_KEY", "KVPLUG_INTEGRITY_KEY_FILE"])
def test_every_command_that_reads_the_key_refuses_an_empty_variable(tmp_path: Path, name: str) -> None:
    """``config show`` used to print "not set" and ``store verify`` passed unsigned records."""
    folder = tmp_path / "store"
    folder.mkdir()
    config = tmp_path / "c.yaml"
    config.write_text(f"tiers: [{{type: disk, path: {folder}}}]\n")
    for args in (
        ["config", "show", "-f", str(config)],
        ["config", "validate", str(config)],
        ["store", "verify", str(folder)],
    ):
        result = kvplug_cli(*args, env_update={name: ""})
        message = " ".join(result.stderr.split())
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert f"env {name}: is set but empty" in message, (args, message)
        assert "Traceback" not in result.stderr
    shown = kvplug_cli("config", "show", "-f", str(config), env_update={"KVPLUG_INTEGRITY_KEY": KEY})
    assert shown.returncode == 0 and "env KVPLUG_INTEGRITY_KEY" in shown.stdout and KEY not in shown.stdout


def test_a_key_file_longer_than_the_limit_is_refused_not_cut(tmp_path: Path) -> None:
    """Two keys that differ only past byte 4096 used to be the same key (the file was read to 4096)."""
    limit = record.MAX_INTEGRITY_KEY_FILE_BYTES
    files = []
    for tail in (b"A", b"B"):
        path = tmp_path / f"key{tail.decode()}"
        path.write_bytes(b"k" * limit + tail)
        path.chmod(0o600)
        files.append(path)
    for path in files:
        with pytest.raises(ConfigError) as info:
            record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY_FILE": str(path)})
        assert str(info.value) == (
            "invalid kvplug config in environment:\n  - env KVPLUG_INTEGRITY_KEY_FILE: "
            f"the key file {path} is longer than {limit} bytes, the most a key file may hold (is it the right "
            "file?); a key needs at least 16 bytes: 32 random bytes as hex, openssl rand -hex 32, are 64 "
            f"(got '{path}')"
        )
    exact = tmp_path / "exact"
    exact.write_bytes(b"k" * (limit - 1) + b"x")
    exact.chmod(0o600)
    assert record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY_FILE": str(exact)}) == record.IntegrityKey(
        b"k" * (limit - 1) + b"x"
    )


def test_a_key_file_too_short_is_refused_with_the_whole_reason(tmp_path: Path) -> None:
    short = tmp_path / "short"
    short.write_bytes(b"short\n")
    short.chmod(0o600)
    with pytest.raises(ConfigError) as info:
        record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY_FILE": str(short)})
    assert str(info.value) == (
        "invalid kvplug config in environment:\n  - env KVPLUG_INTEGRITY_KEY_FILE: an integrity key needs at "
        "least 16 bytes (got 5); e.g. 32 random bytes as hex: openssl rand -hex 32 (got '<hidden>')"
    )


@pytest.mark.parametrize("content", [b"", b"\n", b" " * 40 + b"\n", b"\t \r\n" * 8])
def test_an_empty_or_blank_key_file_is_refused_like_an_empty_variable(tmp_path: Path, content: bytes) -> None:
    """40 spaces and a newline used to be a key, while a variable of 40 spaces was refused."""
    blank = tmp_path / "blank"
    blank.write_bytes(content)
    blank.chmod(0o600)
    with pytest.raises(ConfigError) as info:
        record.resolve_integrity_key({"KVPLUG_INTEGRITY_KEY_FILE": str(blank)})
    got = repr(str(blank)) if len(repr(str(blank))) <= 80 else repr(str(blank))[:77] + "..."  # a long one is cut
    assert str(info.value) == (
        "invalid kvplug config in environment:\n  - env KVPLUG_INTEGRITY_KEY_FILE: "
        f"the key file {blank} is empty (or only white space): give it the key (e.g. openssl rand -hex 32), "
        f"or unset the variable to run without a key (got {got})"
    )
