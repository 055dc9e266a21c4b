"""What lands in the bucket: digest names, record frames; tampered objects are
misses (counted and deleted), never wrong bytes; budget, events and scan."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvplug.testing import key_for, value_for
from kvplug_s3.testing import BUCKET, make_s3_tier, s3_options


def object_key(prefix: str, key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{prefix}/{digest[:2]}/{digest}"


def stored_names(client, prefix: str) -> list[str]:
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
    return sorted(item["Key"] for item in listing.get("Contents", []))


def test_objects_are_named_by_digest_and_framed(moto_s3, s3_client) -> None:
    tier = make_s3_tier(moto_s3.endpoint, prefix="naming")
    keys = [key_for(f"n{i}") for i in range(5)]
    tier.put([(k, value_for(k, 300)) for k in keys])
    names = stored_names(s3_client, "naming")
    assert names == sorted(object_key("naming", k) for k in keys)
    for key, name in zip(keys, names):
        assert re.fullmatch(r"naming/[0-9a-f]{2}/[0-9a-f]{64}", name)
        assert not any(part in name for part in key.split("/"))  # no key text in any name
    body = s3_client.get_object(Bucket=BUCKET, Key=object_key("naming", keys[0]))["Body"].read()
    assert body[:4] == b"KVPR" and len(body) == 64 + 300 and body[64:] == value_for(keys[0], 300)
    tier.close()


def flip(data: bytes, offset: int) -> bytes:
    return data[:offset] + bytes([data[offset] ^ 0x01]) + data[offset + 1 :]


TAMPERING = {
    "flipped value byte": lambda own, other: flip(own, len(own) - 7),
    "flipped header byte": lambda own, other: flip(own, 20),
    "truncated": lambda own, other: own[:-100],
    "header only": lambda own, other: own[:64],
    "shorter than a header": lambda own, other: own[:10],
    "empty": lambda own, other: b"",
    "another key's object": lambda own, other: other,
    "raw value without frame": lambda own, other: own[64:],
}


@pytest.mark.parametrize("how", sorted(TAMPERING))
def test_tampered_objects_are_misses_counted_and_removed(how: str, moto_s3, s3_client) -> None:
    tier = make_s3_tier(moto_s3.endpoint)
    prefix = tier.config.url.split(f"{BUCKET}/", 1)[1]
    victim, other = key_for("victim"), key_for("other")
    tier.put([(victim, value_for("victim", 5000)), (other, value_for("other", 5000))])
    own = s3_client.get_object(Bucket=BUCKET, Key=object_key(prefix, victim))["Body"].read()
    others = s3_client.get_object(Bucket=BUCKET, Key=object_key(prefix, other))["Body"].read()
    s3_client.put_object(Bucket=BUCKET, Key=object_key(prefix, victim), Body=TAMPERING[how](own, others))

    got = tier.get([victim, other])
    assert got[0] is None
    assert bytes(got[1]) == value_for("other", 5000)
    stats = tier.stats()
    assert stats.extra["corrupt"] == 1 and stats.misses == 1 and stats.hits == 1
    assert object_key(prefix, victim) not in stored_names(s3_client, prefix)
    assert tier.contains([victim, other]) == [False, True]
    tier.close()


def test_budget_evicts_least_recently_used_objects_and_reports_them(moto_s3, s3_client) -> None:
    events: list = []
    tier = make_s3_tier(moto_s3.endpoint, prefix="budget", events=events, max_bytes=3000)
    keys = [key_for(f"b{i}") for i in range(4)]
    tier.put([(keys[0], b"0" * 1000), (keys[1], b"1" * 1000), (keys[2], b"2" * 1000)])
    tier.get([keys[0]])
    tier.put([(keys[3], b"3" * 1000)])
    stored = [("stored", tuple(keys[:3])), ("stored", (keys[3],))]  # each put, once the objects are there
    assert [(e.kind, e.keys) for e in events] == [*stored, ("evicted", (keys[1],))]
    assert stored_names(s3_client, "budget") == sorted(object_key("budget", k) for k in (keys[0], keys[2], keys[3]))
    tier.remove([keys[2], key_for("never")])
    assert events[-1].kind == "removed" and events[-1].keys == (keys[2],)
    stats = tier.stats()
    assert (stats.items, stats.bytes_used, stats.evictions) == (2, 2000, 1)
    tier.close()


def test_a_new_tier_indexes_what_is_stored_and_applies_its_budget(moto_s3, s3_client) -> None:
    first = make_s3_tier(moto_s3.endpoint, prefix="reindex")
    keys = [key_for(f"r{i}") for i in range(6)]
    for key in keys:  # one at a time, so modification times follow the order
        first.put([(key, value_for(key, 1000))])
    first.close()

    second = make_s3_tier(moto_s3.endpoint, prefix="reindex")
    second.flush()
    assert (second.stats().items, second.stats().bytes_used) == (6, 6000)
    scanned = list(second.records())
    assert sorted(o.digest for o in scanned) == sorted(hashlib.sha256(k.encode()).hexdigest() for k in keys)
    assert all(o.size == 1064 for o in scanned)
    second.close()

    smaller = make_s3_tier(moto_s3.endpoint, prefix="reindex", max_bytes=4000)
    smaller.flush()
    assert smaller.stats().bytes_used <= 4000 and smaller.stats().evictions == 2
    assert len(stored_names(s3_client, "reindex")) == 4
    smaller.close()


def test_temporary_files_of_file_urls_are_not_objects(tmp_path) -> None:
    from kvplug.testing import tier_context
    from kvplug_s3 import S3Tier

    tier = S3Tier(S3Tier.Config(url=f"file://{tmp_path}"), tier_context())
    tier.put([(key_for("f"), b"x" * 10)])
    digest = hashlib.sha256(key_for("f").encode()).hexdigest()
    (tmp_path / digest[:2] / f".{digest}.tmp-deadbeef").write_bytes(b"partial")
    assert [o.digest for o in tier.records()] == [digest]
    assert sorted(p.name for p in (tmp_path / digest[:2]).iterdir()) == sorted([digest, f".{digest}.tmp-deadbeef"])
    tier.close()


#: A writer that dies between writing its temporary and renaming it into place.
_KILLED_WRITER = """
import os, signal, sys
from kvplug.testing import tier_context
from kvplug_s3 import S3Tier

os.rename = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
tier = S3Tier(S3Tier.Config(url="file://" + sys.argv[1]), tier_context())
tier.put([(sys.argv[2], b"x" * 100_000)])
"""


def test_temporaries_of_killed_writers_are_removed_when_stale(tmp_path) -> None:
    """``file://``: a writer killed before its rename left its temporary for ever, outside the
    budget; a tier's start-up listing removes one an hour old, never a live writer's, and an
    inspection (read-only) removes nothing."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from kvplug.testing import tier_context
    from kvplug_s3 import S3Tier
    from kvplug_s3.threaded import STALE_TEMPORARY_S

    killed = subprocess.run([sys.executable, "-c", _KILLED_WRITER, str(tmp_path), key_for("killed")], timeout=120)
    assert killed.returncode == -signal.SIGKILL
    digest = hashlib.sha256(key_for("killed").encode()).hexdigest()
    [left] = list((tmp_path / digest[:2]).iterdir())
    assert re.fullmatch(rf"\.{digest}\.tmp-[0-9a-f]{{32}}", left.name)
    stale = time.time() - STALE_TEMPORARY_S - 60
    os.utime(left, (stale, stale))
    live = tmp_path / digest[:2] / f".{digest}.tmp-{'0' * 32}"  # a writer still at work
    live.write_bytes(b"partial")

    for context in (tier_context(read_only=True), tier_context()):
        tier = S3Tier(S3Tier.Config(url=f"file://{tmp_path}"), context)
        tier.flush()  # the start-up listing is done
        assert list(tier.records()) == []
        tier.close()
        assert left.exists() == context.read_only
    assert live.exists()


def test_reused_upload_buffers_never_mix_values(moto_s3) -> None:
    """Values of one size reuse upload buffers: every object still holds its own value."""
    tier = make_s3_tier(moto_s3.endpoint, frame_buffer_bytes=64 * 1024)
    keys = [key_for(f"reuse{i}") for i in range(24)]
    for start in range(0, 24, 4):
        tier.put([(k, value_for(k, 8000)) for k in keys[start : start + 4]])
    assert [bytes(v) for v in tier.get(keys)] == [value_for(k, 8000) for k in keys]
    tier.close()


def test_frame_buffers_are_whole_records_reused_within_their_bound() -> None:
    from kvplug import unpack_record
    from kvplug.core.records.frame import pack_record_header
    from kvplug_s3.frames import FrameBuffers

    def frame(key: str, value: bytes) -> bytearray:
        return pool.frame(pack_record_header(key, value), memoryview(value))

    pool = FrameBuffers(max_bytes=2 * (64 + 100))
    first = frame("a", b"x" * 100)
    assert bytes(unpack_record(first, "a")) == b"x" * 100
    pool.release(first)
    assert pool.held_bytes == 164
    second = frame("b", b"y" * 100)
    assert second is first and bytes(unpack_record(second, "b")) == b"y" * 100
    held = [frame(str(i), b"z" * 100) for i in range(3)]
    for buffer in held:
        pool.release(buffer)
    assert pool.held_bytes == 2 * 164
    reused = [frame("c", b"c" * 100) for _ in range(3)]
    assert [any(buffer is h for h in held) for buffer in reused] == [True, True, False]  # only two fit the bound


def test_a_frame_returns_to_the_pool_only_after_its_upload_finished(moto_s3) -> None:
    """An upload abandoned at its deadline may still be sending from its frame: that
    frame never goes back to the pool; one whose upload finished does."""
    import asyncio

    from kvplug import RecordToWrite, key_digest
    from kvplug.core.records.frame import pack_record_header
    from kvplug_s3 import S3TierConfig
    from kvplug_s3.backend import AsyncObjectBackend, open_object_backend
    from kvplug_s3.testing import FaultProxy, s3_options

    proxy = FaultProxy(moto_s3.port)
    loop = asyncio.new_event_loop()
    backend = open_object_backend(S3TierConfig(**s3_options(proxy.endpoint)), loop)
    assert isinstance(backend, AsyncObjectBackend) and backend.frames is not None
    key = key_for("frame")
    value = memoryview(value_for("frame", 10_000))
    record = RecordToWrite(key_digest(key).hex(), pack_record_header(key, value), value)

    async def abandon_once_sent() -> asyncio.Task:
        # Abandoned once the server holds the whole upload, not at a fixed deadline: on
        # a loaded machine a 1 s deadline can fall before the request is even sent.
        upload = asyncio.ensure_future(backend.write([record]))
        async with asyncio.timeout(30):
            while proxy.swallowed_bytes < record.size and not upload.done():
                await asyncio.sleep(0.01)
        upload.cancel()
        await asyncio.gather(upload, return_exceptions=True)
        return upload

    try:
        loop.run_until_complete(backend.open())
        proxy.set_mode("hang")  # the upload is sent and never answered
        assert loop.run_until_complete(abandon_once_sent()).cancelled()
        assert backend.frames.held_bytes == 0
        proxy.set_mode("pass")
        assert loop.run_until_complete(backend.write([record])) == [None]
        assert backend.frames.held_bytes == record.size
        assert bytes(loop.run_until_complete(backend.read([record.name], [None]))[0]) == record.joined()
    finally:
        loop.run_until_complete(backend.close())
        loop.close()
        proxy.close()


def test_a_record_read_costs_its_size_once_not_its_pieces_joined(moto_s3) -> None:
    """A read takes a record's body into one buffer of the size the answer reports, not as
    pieces joined at the end (which held it twice): measured by tracemalloc in a reader
    process (the server, in this one, keeps copies of its own)."""
    size = 32 * 1024**2
    options = s3_options(moto_s3.endpoint, prefix="peak")
    writer = make_s3_tier(moto_s3.endpoint, prefix="peak")
    writer.put([(key_for("big"), value_for("big", size))])
    writer.close()
    script = str(Path(__file__).with_name("s3_reader_memory.py"))
    bound = str(2 * size)  # as an engine's bound: well over the record
    reader = subprocess.run(
        [sys.executable, script, json.dumps(options), key_for("big"), bound],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reader.returncode == 0, reader.stderr
    peak, read = map(int, reader.stdout.split())
    assert read == size
    assert peak < 1.5 * size, f"reading a {size}-byte record held {peak} bytes at its peak"


def test_objects_deleted_behind_the_tiers_back_leave_its_budget(s3_server) -> None:
    """Another process (or a lifecycle rule) deletes objects: the budget stops counting them
    before it evicts good records to make room that is already free."""
    prefix = f"behind-{s3_server.__class__.__name__.lower()}"
    events: list = []
    tier = make_s3_tier(s3_server.endpoint, prefix=prefix, events=events, max_bytes=10 * 1064)
    kept = [key_for(f"kept-{i}") for i in range(3)]
    deleted = [key_for(f"deleted-{i}") for i in range(5)]
    for key in kept + deleted:  # one at a time: the kept records are the least recently used
        tier.put([(key, value_for(key, 1000))])
    client = s3_server.client()
    for key in deleted:
        client.delete_object(Bucket=BUCKET, Key=object_key(prefix, key))

    newer = [key_for(f"newer-{i}") for i in range(5)]
    for key in newer:  # 3 + 5 records stored: within the budget of 10
        tier.put([(key, value_for(key, 1000))])
    assert tier.stats().evictions == 0, tier.stats()
    assert [bytes(v) for v in tier.get(kept)] == [value_for(k, 1000) for k in kept]
    assert (tier.stats().items, tier.stats().bytes_used) == (8, 8 * 1000)
    assert sorted(k for e in events if e.kind == "removed" for k in e.keys) == sorted(deleted)
    tier.close()
