"""``kvplug ctl`` and its control protocol against a real cache engine's control server.

The server runs on its own thread in this process, with a real cpu and disk tier; the
CLI is the real ``kvplug ctl`` (typer's runner); the bad clients are real sockets, and
the other user is a real process running as ``nobody``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, random_caches
from typer.testing import CliRunner

from kvplug import (
    CacheEngine,
    ControlIdentity,
    ControlServer,
    EngineControl,
    ExtraKey,
    Fingerprint,
    RequestInfo,
    load_config,
)
from kvplug.cli.main import app
from kvplug.core.control.client import ask, find_ranks
from kvplug.core.control.message_server import ServerLimits
from kvplug.core.control.protocol import MAX_CONTROL_MESSAGE, encode_request, exchange
from kvplug.errors import ControlError, SocketInUseError
from kvplug.testing import send_as_other_user

LAYOUT = LAYOUTS["vllm_flash"]  # float16, block 4
TOKENS = list(range(100, 140))  # five chunks of 8
OTHER = list(range(500, 524))  # three chunks of 8
_LEN = struct.Struct("<I")


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[CacheEngine]:
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "64MiB"}]  # fmt: skip
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}).config
    with CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="m")) as cache:
        yield cache


@pytest.fixture
def server(engine: CacheEngine, socket_dir: Path) -> Iterator[ControlServer]:
    served = ControlServer(engine, ControlIdentity("engine-a", "tiny", "test", tp_rank=0, tp_size=1))
    yield served
    served.close()


def store(engine: CacheEngine, tokens: list[int], salt: str | None = None) -> None:
    caches = random_caches(LAYOUT, 80)
    engine.store(tokens, caches, torch.arange(len(tokens)), request=RequestInfo(cache_salt=salt))
    engine.flush()


def connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    return sock


def closed_without_reply(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def ctl(*args: str) -> Any:
    result = CliRunner().invoke(app, ["ctl", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


# --- protocol --------------------------------------------------------------------------------


def test_an_oversize_message_closes_only_its_connection(server: ControlServer) -> None:
    with connect(server.path) as sock:
        sock.sendall(_LEN.pack(MAX_CONTROL_MESSAGE + 1))  # the length alone: nothing more is read
        assert closed_without_reply(sock)
    assert ask(server.path, "info")["engine_id"] == "engine-a"


@pytest.mark.parametrize(
    "body",
    [
        b"\xff\xff\x00\x00{}",  # a header length past the message
        _LEN.pack(5) + b"nope!",  # not JSON
        _LEN.pack(2) + b"[]",  # not an object
        encode_request("drop_tables"),  # an unknown op
        encode_request("lookup", {"cache_salt": 7}),  # a field of the wrong type
        encode_request("lookup", {"cache_salt": "s" * 5000}),  # too long
        encode_request("lookup", {"extra_keys": [[0, "x", "v"]]}),
        encode_request("lookup", {"extra_keys": [[0, 1 << 64, "v"]]}, tokens=[1, 2]),  # past int64
        encode_request("lookup", tokens=[1, 2]) + b"\x01",  # tokens not whole int64s
        _LEN.pack(60_000) + b"[" * 60_000,  # nests past the JSON parser's depth (RecursionError)
        _LEN.pack(25) + b'{"v": 1, "op": "' + b"\xff" * 8 + b'"}',  # not UTF-8
    ],
)
def test_a_malformed_request_closes_its_connection(server: ControlServer, body: bytes) -> None:
    with connect(server.path) as sock, connect(server.path) as bystander:
        sock.sendall(_LEN.pack(len(body)) + body)
        assert closed_without_reply(sock)
        assert exchange(bystander, encode_request("info"))["engine_id"] == "engine-a"  # other clients go on


def test_clients_holding_the_buffer_budget_delay_others_never_refuse_them(
    engine: CacheEngine, socket_dir: Path
) -> None:
    """Two connections that each send most of a largest message and stall fill the budget of
    all connections: a third client waits until they are dropped (their read deadline), and
    is answered; it is not closed for their bytes."""
    limits = ServerLimits(max_message_bytes=1 << 20, max_buffered_bytes=2 << 20, read_deadline_s=1.0)
    server = ControlServer(engine, ControlIdentity("engine-a", "tiny", "test"), limits=limits)
    hogs = [connect(server.path) for _ in range(2)]
    try:
        for hog in hogs:
            hog.sendall(_LEN.pack(1 << 20) + b"\0" * ((1 << 20) - 1))
        assert ask(server.path, "info", timeout_s=60)["engine_id"] == "engine-a"
        assert all(closed_without_reply(hog) for hog in hogs)
    finally:
        for hog in hogs:
            hog.close()
        server.close()


def test_senders_that_all_wait_for_room_do_not_wedge_the_server(engine: CacheEngine, socket_dir: Path) -> None:
    """Three clients' big requests, each begun, fill the budget of all connections and each
    needs more room: the one holding most is closed, and the other two are answered."""
    limits = ServerLimits(max_message_bytes=1 << 20, max_buffered_bytes=2 << 20, read_deadline_s=30.0)
    server = ControlServer(engine, ControlIdentity("engine-a", "tiny", "test"), limits=limits)
    num_tokens = ((1 << 20) - 200) // 8
    body = encode_request("lookup", tokens=list(range(num_tokens)))
    message = _LEN.pack(len(body)) + body
    clients = [connect(server.path) for _ in range(3)]
    try:
        firsts = [700_000, 720_000, 680_000]  # 2.1 MB begun in all, over the 2 MiB budget
        for client, first in zip(clients, firsts):
            client.sendall(message[:first])
        with ThreadPoolExecutor(3) as pool:
            rest = [pool.submit(c.sendall, message[f:]) for c, f in zip(clients, firsts)]
            replies = []
            for client in clients:
                try:
                    replies.append(exchange_reply(client))
                except (ConnectionError, OSError):
                    replies.append(None)
            for sent in rest:
                try:
                    sent.result(timeout=60)
                except OSError:
                    pass
        assert replies[1] is None, "the client holding most bytes is closed"
        assert [r["num_tokens"] for r in replies if r is not None] == [num_tokens] * 2
    finally:
        for client in clients:
            client.close()
        server.close()


def exchange_reply(sock: socket.socket) -> dict[str, Any]:
    """The reply to a request already sent on ``sock``."""
    head = b""
    while len(head) < 4:
        part = sock.recv(4 - len(head))
        if not part:
            raise ConnectionError("closed")
        head += part
    (length,) = _LEN.unpack(head)
    data = b""
    while len(data) < length:
        part = sock.recv(length - len(data))
        if not part:
            raise ConnectionError("closed")
        data += part
    reply: dict[str, Any] = json.loads(data)
    return reply


def test_a_second_server_does_not_take_over_a_served_socket(server: ControlServer, engine: CacheEngine) -> None:
    """Two engines with one identity (one socket path): the second is refused, naming the path;
    the first keeps its socket and answers."""
    with pytest.raises(SocketInUseError, match=str(server.path)):
        ControlServer(engine, ControlIdentity("engine-a", "again", "test"))
    assert server.path.exists() and ask(server.path, "info")["name"] == "tiny"


def test_a_server_that_cannot_start_leaves_the_callers_target_journaling(
    server: ControlServer, engine: CacheEngine
) -> None:
    """An adapter keeps its target for its own clears and resets (vLLM's prefix cache reset):
    a second server refused on the same socket must not stop that target's journal."""
    target = EngineControl(engine)
    try:
        with pytest.raises(SocketInUseError):
            ControlServer(target, ControlIdentity("engine-a", "again", "test"))
        store(engine, TOKENS)
        _, done = target.remove(target.planned_clear)
        assert sum(len(removal.removed) for removal in done) == 2 * 5  # five chunks, in both tiers
    finally:
        target.close()


def test_another_protocol_version_is_refused_by_name(server: ControlServer) -> None:
    with connect(server.path) as sock:
        reply = exchange(sock, encode_request("stats", version=2))
        assert reply["kind"] == "version" and "speaks version 1" in reply["error"]
        assert exchange(sock, encode_request("info"))["engine_id"] == "engine-a"  # the connection stays usable


def test_a_client_of_another_user_cannot_connect(server: ControlServer, caplog: pytest.LogCaptureFixture) -> None:
    if os.getuid() != 0:
        pytest.fail("this test runs a client as nobody, which needs root (as here and in CI)")
    request = encode_request("info")
    assert send_as_other_user(server.path, request, dac_override=False) == "connect 13"  # EACCES: the 0700 folder
    # Past the folder (a capability): the server reads the peer's uid and closes at once.
    assert send_as_other_user(server.path, request, dac_override=True) in ("reply b''", "closed 32", "closed 104")
    assert "runs as uid 65534" in caplog.text  # refused by SO_PEERCRED, before a byte was read
    assert ask(server.path, "info")["engine_id"] == "engine-a"


def test_at_the_connection_cap_another_users_connection_closes_none_of_the_owners(server: ControlServer) -> None:
    """The oldest connection was dropped to make room before the peer check
    refused the newcomer, so another user could close the owner's connections one by one."""
    if os.getuid() != 0:
        pytest.fail("this test runs a client as nobody, which needs root (as here and in CI)")
    owners = [connect(server.path) for _ in range(server.limits.max_connections)]
    try:
        for sock in owners:  # each is accepted and answered: all are open on the server
            assert exchange(sock, encode_request("info"))["engine_id"] == "engine-a"
        assert send_as_other_user(server.path, encode_request("info"), dac_override=True) in (
            "reply b''", "closed 32", "closed 104",
        )  # fmt: skip
        for sock in owners:
            assert exchange(sock, encode_request("info"))["engine_id"] == "engine-a"
    finally:
        for sock in owners:
            sock.close()


# --- ops and the command line ------------------------------------------------------------------


def test_ctl_list_stats_lookup_and_explain(server: ControlServer, engine: CacheEngine, tmp_path: Path) -> None:
    store(engine, TOKENS)
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps([*TOKENS, 7, 7, 7]))
    (listed,) = ctl("list")["ranks"]
    assert listed["engine_id"] == "engine-a" and listed["name"] == "tiny" and listed["tiers"] == ["0:cpu", "1:disk"]
    stats = ctl("stats")
    assert stats["total"]["metrics"]["kvplug_stored_tokens_total"] == 40
    assert {row["tier"]: row["items"] for row in stats["total"]["tiers"]} == {
        "0:cpu": 6,
        "1:disk": 6,
    }  # and the manifest
    looked = ctl("lookup", str(prompt), "--engine", "tiny")
    assert looked["total"]["hit_tokens"] == 40 and looked["ranks"][0]["chunks"] == [["cpu", 8]] * 5
    assert ctl("lookup", str(prompt), "--cache-salt", "t1")["total"]["hit_tokens"] == 0
    # In words: a hit of 0 said "(every rank holds it)".
    said = CliRunner().invoke(app, ["ctl", "lookup", str(prompt)]).output
    assert said.startswith("hit: 40 of 43 tokens (the prefix every rank holds); 5 chunks held over 1 rank(s)"), said
    said = CliRunner().invoke(app, ["ctl", "lookup", str(prompt), "--cache-salt", "t1"]).output
    assert said.startswith("hit: 0 of 43 tokens (no rank holds its first chunk, or not every rank)"), said
    explained = ctl("explain", str(prompt))["ranks"][0]
    assert explained["hit_tokens"] == 40 and explained["chunks"][0]["tiers"] == [
        "0:cpu",
        "1:disk",
    ]  # the memory tier too
    assert "partial chunk" in explained["reason"]
    # In words, at 80 columns (headers were cut to "med…", "bud…"): every line fits, no cell is cut.
    said = CliRunner().invoke(app, ["ctl", "tiers"], env={"COLUMNS": "80"}).output
    assert said and max(map(len, said.splitlines())) <= 80 and "…" not in said, said
    assert "medium: memory" in said or "┃ medium" in said, said
    tiers = ctl("tiers")["total"]["tiers"]
    assert tiers[0]["max_bytes"] == 64 * 2**20 and tiers[0]["breaker_state"] == "-"


def test_ctl_clear_removes_one_salt_from_one_tier_and_says_so(server: ControlServer, engine: CacheEngine) -> None:
    store(engine, TOKENS, salt="tenant-a")
    store(engine, OTHER, salt="tenant-b")
    result = CliRunner().invoke(app, ["ctl", "clear"])
    assert result.exit_code == 2 and "exactly one of --salt S, --no-salt, --all" in result.output
    # --all with --lora would clear every LoRA's chunks: refused, by the CLI and by the engine.
    result = CliRunner().invoke(app, ["ctl", "clear", "--all", "--lora", "adapter-1"])
    assert result.exit_code == 2 and "--all clears every cache_salt and every LoRA" in result.output
    with pytest.raises(ControlError, match="all_salts clears every salt and LoRA"):
        ask(server.path, "clear", {"all_salts": True, "lora_id": "adapter-1"})
    assert engine.lookup(OTHER, request=RequestInfo(cache_salt="tenant-b")) == 24  # nothing removed
    cleared = ctl("clear", "--salt", "tenant-a", "--tier", "cpu")["total"]
    assert cleared["removed"] == {"0:cpu": 5} and cleared["scope"] == "cache_salt 'tenant-a'"
    assert cleared["bytes_freed"]["0:cpu"] > 0
    a, b = RequestInfo(cache_salt="tenant-a"), RequestInfo(cache_salt="tenant-b")
    assert [loc.tier for loc in engine.locate(TOKENS, request=a)] == ["disk"] * 5  # still on disk
    assert [loc.tier for loc in engine.locate(OTHER, request=b)] == ["cpu"] * 3  # another tenant untouched
    everything = ctl("clear", "--all")["total"]
    assert everything["removed"] == {"0:cpu": 3, "1:disk": 8} and everything["scope"] == "every cache_salt"
    assert engine.lookup(OTHER, request=b) == 0 and engine.lookup(TOKENS, request=a) == 0
    result = CliRunner().invoke(app, ["ctl", "clear", "--all", "--tier", "s3"])
    assert result.exit_code == 2 and "no tier 's3'" in result.output


def test_ctl_names_the_engines_when_several_run(server: ControlServer, engine: CacheEngine) -> None:
    second = ControlServer(engine, ControlIdentity("engine-b", "other", "test"))
    try:
        result = CliRunner().invoke(app, ["ctl", "stats"])
        assert result.exit_code == 2 and "2 engines match" in result.output and "engine-b (other)" in result.output
        assert ctl("stats", "--engine", "engine-b")["engine"] == "engine-b"
        assert ctl("stats", "-e", "engine-a")["engine"] == "engine-a"
    finally:
        second.close()
    assert len(find_ranks().ranks) == 1


def test_no_engine_is_a_clear_error(socket_dir: Path) -> None:
    result = CliRunner().invoke(app, ["ctl", "stats"])
    assert result.exit_code == 2 and "no engine is running" in result.output
    with pytest.raises(ControlError, match="no kvplug socket"):
        ask(socket_dir / "ctl-0.sock", "info")


def test_ctl_pin_and_unpin(server: ControlServer, engine: CacheEngine, tmp_path: Path) -> None:
    store(engine, TOKENS, salt="t")
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, TOKENS)))
    pinned = ctl("pin", str(prompt), "--cache-salt", "t")["total"]
    assert pinned["chunks"] == 5 and pinned["bytes"] > 0 and pinned["refused"] == pinned["missing"] == 0
    assert pinned["tokens"] == 40
    said = " ".join(CliRunner().invoke(app, ["ctl", "pin", str(prompt), "--cache-salt", "t"]).output.split())
    assert "covering 40 prompt tokens on every rank" in said, said
    assert ctl("pin", str(prompt))["total"]["missing"] == 5  # unsalted: another tenant's keys, none stored
    assert ctl("unpin", str(prompt), "--cache-salt", "t")["total"]["chunks"] == 5


def test_ctl_keys_a_lora_prompt_by_the_adapters_source_too(
    server: ControlServer, engine: CacheEngine, tmp_path: Path
) -> None:
    adapter = RequestInfo(lora_id="sql", extra_keys=(ExtraKey.adapter_source("/adapters/sql-v2"),))
    engine.store(TOKENS, random_caches(LAYOUT, 80), torch.arange(len(TOKENS)), request=adapter)
    engine.flush()
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(TOKENS))
    assert ctl("lookup", str(prompt), "--lora", "sql", "--lora-path", "/adapters/sql-v2")["total"]["hit_tokens"] == 40
    assert ctl("lookup", str(prompt), "--lora", "sql", "--lora-path", "/adapters/sql-v1")["total"]["hit_tokens"] == 0
    assert ctl("lookup", str(prompt), "--lora", "sql")["total"]["hit_tokens"] == 0
    pinned = ctl("pin", str(prompt), "--lora", "sql", "--lora-path", "/adapters/sql-v2")["total"]
    assert pinned["chunks"] == 5 and pinned["missing"] == 0


def test_lookup_answers_typed_locations_and_reset_needs_the_adapters_reset(
    server: ControlServer, engine: CacheEngine
) -> None:
    store(engine, list(range(100, 124)))
    with connect(server.path) as sock:
        reply = exchange(sock, encode_request("lookup", tokens=list(range(100, 124))))
        assert [row[:3] for row in reply["locations"]] == [["memory", "cpu", 8]] * 3
        assert [row[3] for row in reply["locations"]] == [
            k.key.rpartition("/")[2] for k in engine.chunk_keys(list(range(100, 124)))
        ]
        assert reply["chunks"] == [["cpu", 8]] * 3
        refused = exchange(sock, encode_request("reset"))
        assert refused["kind"] == "bad_request" and "no cache reset" in refused["error"]
