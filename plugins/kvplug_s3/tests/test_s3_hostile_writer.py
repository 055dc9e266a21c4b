"""What a writer of the bucket can make a reader do: an object too big for any record of
the engine is a miss before its body is read, and records of a tier on a nested prefix
are not this tier's (not indexed, listed or counted); a newer record version is kept."""

from __future__ import annotations

import hashlib
import struct
import tracemalloc

from kvplug.core.records.frame import pack_record
from kvplug.testing import key_for, tier_context, value_for
from kvplug_s3 import S3Tier
from kvplug_s3.testing import BUCKET, FaultProxy, make_s3_tier, s3_options

#: The largest record the reading engine can store or read (its ``max_record_bytes``).
BOUND = 64 + 64 * 1024
#: A planted object far over the bound: reading it whole would cost a reader this much.
PLANTED = 64 * 1024**2


def object_key(prefix: str, key: str) -> str:
    digest = hashlib.sha256(key.encode()).hexdigest()
    return f"{prefix}/{digest[:2]}/{digest}"


def test_an_object_over_the_record_bound_is_a_miss_without_its_body_read(moto_s3, s3_client) -> None:
    proxy = FaultProxy(moto_s3.port)
    tier = S3Tier(S3Tier.Config(**s3_options(proxy.endpoint)), tier_context(max_record_bytes=BOUND))
    try:
        prefix = tier.config.url.split(f"{BUCKET}/", 1)[1]
        victim, other = key_for("planted"), key_for("kept")
        tier.put([(victim, value_for("planted", 4096)), (other, value_for("kept", 4096))])
        # A whole, valid record of the victim's key: only its size gives it away.
        s3_client.put_object(Bucket=BUCKET, Key=object_key(prefix, victim), Body=pack_record(victim, b"\x07" * PLANTED))
        before = proxy.answered_bytes
        got = tier.get([victim, other])
        received = proxy.answered_bytes - before
        assert got[0] is None and bytes(got[1]) == value_for("kept", 4096)
        # Socket buffers may hold a few MiB of the body when the reader hangs up; not most of it.
        assert received < PLANTED // 4, f"the reader received {received} bytes of a {PLANTED}-byte object"
        assert tier.stats().extra["corrupt"] == 1
        listing = s3_client.list_objects_v2(Bucket=BUCKET, Prefix=prefix + "/")
        assert [item["Key"] for item in listing.get("Contents", [])] == [object_key(prefix, other)]
    finally:
        tier.close()
        proxy.close()


def test_records_of_a_nested_prefix_are_not_this_tiers(moto_s3, s3_client) -> None:
    inner = make_s3_tier(moto_s3.endpoint, prefix="nest/inner")
    inner.put([(key_for("inner"), value_for("inner", 1000))])
    inner.close()
    outer = make_s3_tier(moto_s3.endpoint, prefix="nest", scan_on_start=True, max_bytes=1_000_000)
    try:
        outer.put([(key_for("outer"), value_for("outer", 500))])
        outer.flush()
        assert (outer.stats().items, outer.stats().bytes_used) == (1, 500)
        assert [record.digest for record in outer.records()] == [hashlib.sha256(key_for("outer").encode()).hexdigest()]
        assert object_key("nest/inner", key_for("inner")) in [
            item["Key"] for item in s3_client.list_objects_v2(Bucket=BUCKET, Prefix="nest/")["Contents"]
        ]
    finally:
        outer.close()


def test_a_record_of_a_newer_record_version_is_kept(moto_s3, s3_client) -> None:
    """A newer kvplug sharing the bucket (a rolling upgrade) may lay out its header's last
    bytes otherwise, as version 2 did: its records are incompatible misses, kept, not deleted."""
    tier = make_s3_tier(moto_s3.endpoint)
    try:
        prefix = tier.config.url.split(f"{BUCKET}/", 1)[1]
        newer, own = key_for("newer"), key_for("own")
        tier.put([(own, value_for("own", 1000))])
        record = bytearray(pack_record(newer, value_for("newer", 1000)))
        struct.pack_into("<H", record, 4, 3)  # record version 3
        record[48:64] = bytes(range(16))  # where version 1 has its checksums
        s3_client.put_object(Bucket=BUCKET, Key=object_key(prefix, newer), Body=bytes(record))
        got = tier.get([newer, own])
        assert got[0] is None and bytes(got[1]) == value_for("own", 1000)
        stats = tier.stats().extra
        assert (stats["incompatible"], stats["corrupt"]) == (1, 0)
        assert s3_client.get_object(Bucket=BUCKET, Key=object_key(prefix, newer))["Body"].read() == bytes(record)
    finally:
        tier.close()


def test_a_file_over_the_record_bound_is_a_miss_read_no_further(tmp_path) -> None:
    """``file://`` (a shared folder): a sparse file planted under a record's name, a few KiB on
    disk that claim 256 MiB, is a corrupt miss with at most the bound read."""
    tier = S3Tier(S3Tier.Config(url=f"file://{tmp_path}"), tier_context(max_record_bytes=BOUND))
    try:
        victim, other = key_for("planted"), key_for("kept")
        tier.put([(victim, value_for("planted", 4096)), (other, value_for("kept", 4096))])
        planted = tmp_path / object_key("", victim).lstrip("/")
        with planted.open("r+b") as file:
            file.truncate(256 * 1024**2)
        tracemalloc.start()
        try:
            got = tier.get([victim, other])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got[0] is None and bytes(got[1]) == value_for("kept", 4096)
        assert peak < 16 * 1024**2, f"reading a 256 MiB file allocated {peak} bytes"
        assert tier.stats().extra["corrupt"] == 1
        # A plain folder cannot compare and delete at once: the file is kept, absent to the tier
        # (an engine stores the record again over it).
        assert planted.exists() and tier.contains([victim]) == [False]
    finally:
        tier.close()


#: A FIFO, and a link to one, planted under record names in a ``file://`` store: each read
#: of them, then a put and get of another key; prints what came back.
_FIFO_READER = """
import hashlib, json, os, sys
from kvplug.testing import key_for, tier_context, value_for
from kvplug_s3 import S3Tier

root = sys.argv[1]
tier = S3Tier(S3Tier.Config(url="file://" + root, request_timeout_s=2.0, retries=0), tier_context(max_record_bytes=1 << 20))
paths = {}
for name in ("fifo", "link"):
    digest = hashlib.sha256(key_for(name).encode()).hexdigest()
    os.makedirs(f"{root}/{digest[:2]}", exist_ok=True)
    paths[name] = f"{root}/{digest[:2]}/{digest}"
os.mkfifo(paths["fifo"])
os.mkfifo(root + "/elsewhere")
os.symlink(root + "/elsewhere", paths["link"])
misses = [tier.get([key_for(name)]) for name in ("fifo", "link") for _ in range(20)]
tier.put([(key_for("good"), value_for("good", 100))])
good = tier.get([key_for("good")])[0]
corrupt = tier.stats().extra["corrupt"]
tier.close()
print(json.dumps({
    "misses": all(got == [None] for got in misses),
    "good": good is not None and bytes(good) == value_for("good", 100),
    "corrupt": corrupt,
    "left": [os.path.lexists(path) for path in paths.values()],
    "elsewhere": os.path.exists(root + "/elsewhere"),
}))
"""


def test_a_fifo_under_a_record_name_is_a_corrupt_miss_not_a_hang(tmp_path) -> None:
    """``file://``: opening a FIFO planted under a record name (or a link to one) waited for a
    writer for ever: each read lost a pool thread (the tier stopped once all were) and the
    process could not exit. Only regular files are read, never through a link."""
    import json
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FIFO_READER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.splitlines()[-1])
    # Each read is a corrupt miss; file:// keeps corrupt entries (no delete-if-same there), absent to the tier.
    assert found == {"misses": True, "good": True, "corrupt": 40, "left": [True, True], "elsewhere": True}


def test_a_shard_folder_replaced_by_a_link_is_not_followed(tmp_path) -> None:
    """``file://``: a shard folder replaced by a link made the tier write its records into (and
    read and remove them from) the folder it points to, outside the store. Now the records of
    that shard are not stored (each a dropped put, no failure of the store) and misses."""
    from kvplug.core.records.frame import pack_record as record_of

    store, outside = tmp_path / "store", tmp_path / "outside"
    store.mkdir()
    outside.mkdir()
    tier = S3Tier(S3Tier.Config(url=f"file://{store}", breaker_failures=2), tier_context(max_record_bytes=BOUND))
    try:
        redirected, kept = key_for("redirected"), key_for("kept")
        digest = hashlib.sha256(redirected.encode()).hexdigest()
        assert digest[:2] != hashlib.sha256(kept.encode()).hexdigest()[:2]
        (store / digest[:2]).symlink_to(outside)
        (outside / "planted").write_bytes(record_of(redirected, value_for("planted", 100)))
        (outside / "planted").rename(outside / digest)  # a valid record, reachable only through the link
        assert tier.get([redirected]) == [None]
        for _ in range(3):
            tier.put([(redirected, value_for("redirected", 1000)), (kept, value_for("kept", 1000))])
        assert sorted(p.name for p in outside.iterdir()) == [digest]  # nothing written there
        got = tier.get([redirected, kept])
        assert got[0] is None and bytes(got[1]) == value_for("kept", 1000)
        stats = tier.stats()
        assert stats.extra["breaker_state"] == "closed" and stats.extra["dropped_puts"] == 3
        assert (outside / digest).exists() and (store / digest[:2]).is_symlink()
    finally:
        tier.close()
