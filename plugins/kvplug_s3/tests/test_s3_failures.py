"""What a lookup costs on S3, counted at a TCP proxy on 127.0.0.1 in front of a real
S3 server (moto and SeaweedFS): a miss is one request; a missing bucket, wrong
credentials and refused connections are failures that open the breaker, after
which lookups make no request at all."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplug.testing import key_for, tier_context, value_for
from kvplug_s3 import S3Tier
from kvplug_s3.testing import (
    BUCKET,
    FAST_FAILING,
    READ_ONLY_ACCESS_KEY,
    READ_ONLY_SECRET_KEY,
    FaultProxy,
    MotoS3,
    SeaweedS3,
    free_port,
    listening_addresses,
    make_s3_tier,
    s3_options,
)

KEYS = [key_for(f"trip-{i}") for i in range(4)]
VALUES = [value_for(f"trip-{i}", 30_000 + i) for i in range(4)]


@pytest.fixture
def counting_proxy(s3_server: MotoS3 | SeaweedS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_server.port)
    yield proxy
    proxy.close()


def requests_made(proxy: FaultProxy, call, *args):
    before = dict(proxy.requests)
    result = call(*args)
    made = {m: n - before.get(m, 0) for m, n in proxy.requests.items() if n != before.get(m, 0)}
    return result, made


def test_a_lookup_costs_one_request_per_key_hit_or_miss(counting_proxy: FaultProxy) -> None:
    tier = make_s3_tier(counting_proxy.endpoint)
    try:
        tier.flush()  # the start-up listing is not a lookup
        tier.put([(KEYS[0], VALUES[0])])
        assert requests_made(counting_proxy, tier.contains, [KEYS[1]]) == ([False], {"GET": 1})
        assert requests_made(counting_proxy, tier.get, [KEYS[1]]) == ([None], {"GET": 1})
        assert requests_made(counting_proxy, tier.contains, [KEYS[0]]) == ([True], {"GET": 1})
        got, made = requests_made(counting_proxy, tier.get, [KEYS[0]])
        assert bytes(got[0]) == VALUES[0] and made == {"GET": 1}
        assert requests_made(counting_proxy, tier.contains, KEYS) == ([True, False, False, False], {"GET": 4})
        _, made = requests_made(counting_proxy, tier.put, [(KEYS[1], VALUES[1])])
        assert made == {"PUT": 1}
        assert tier.stats().extra["breaker_state"] == "closed"
    finally:
        tier.close()


def test_an_empty_object_is_not_held(counting_proxy: FaultProxy, s3_server: MotoS3 | SeaweedS3) -> None:
    """A zero-byte object (no byte 0 to read) under a key's name is "not held", not an error."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    tier = make_s3_tier(counting_proxy.endpoint, prefix)
    try:
        digest = hashlib.sha256(KEYS[2].encode()).hexdigest()
        s3_server.client().put_object(Bucket=BUCKET, Key=f"{prefix}/{digest[:2]}/{digest}", Body=b"")
        assert tier.contains([KEYS[2]]) == [False]
        assert tier.stats().extra["failures"] == 0
    finally:
        tier.close()


def assert_fails_then_costs_nothing(tier: S3Tier, proxy: FaultProxy | None) -> None:
    threshold = FAST_FAILING["breaker_failures"]
    for _ in range(threshold):
        assert tier.get(KEYS[:1]) == [None]
        if tier.stats().extra["breaker_state"] == "open":
            break
    stats = tier.stats().extra
    assert stats["breaker_state"] == "open" and stats["failures"] >= threshold, stats
    before = proxy.total_requests() if proxy else 0
    for _ in range(20):
        assert tier.contains(KEYS) == [False] * len(KEYS)
        assert tier.get(KEYS) == [None] * len(KEYS)
    tier.put([(KEYS[0], VALUES[0])])
    after = tier.stats().extra
    assert after["short_circuited"] >= 20 * 2 * len(KEYS) and after["dropped_puts"] >= 1, after
    assert (proxy.total_requests() if proxy else 0) == before, "an open breaker must not send requests"


def test_a_missing_bucket_opens_the_breaker(counting_proxy: FaultProxy) -> None:
    options = s3_options(counting_proxy.endpoint, **FAST_FAILING, breaker_cooldown_s=60.0)
    options["url"] = f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/p"
    tier = S3Tier(S3Tier.Config(**options), tier_context())
    try:
        assert_fails_then_costs_nothing(tier, counting_proxy)
    finally:
        tier.close()


def test_wrong_credentials_open_the_breaker(seaweed_s3: SeaweedS3) -> None:
    """SeaweedFS checks signatures (moto's server accepts any key)."""
    proxy = FaultProxy(seaweed_s3.port)
    tier = make_s3_tier(proxy.endpoint, secret_access_key="not-the-secret", **FAST_FAILING, breaker_cooldown_s=60.0)
    try:
        assert_fails_then_costs_nothing(tier, proxy)
    finally:
        tier.close()
        proxy.close()


def test_a_refusing_store_gets_one_put_per_cool_down_however_many_are_due(seaweed_s3: SeaweedS3) -> None:
    """Puts stored at once when the cool-down has passed: one is sent (it may be refused
    again), the others refused without a request (eab791a: every put then in flight was sent,
    ``assert made == {"PUT": 1}`` saw one PUT per record of the batch)."""
    proxy = FaultProxy(seaweed_s3.port)
    cooldown_s = 0.3
    reader = make_s3_tier(
        proxy.endpoint,
        f"t-{uuid.uuid4().hex[:12]}",
        access_key_id=READ_ONLY_ACCESS_KEY,
        secret_access_key=READ_ONLY_SECRET_KEY,
        **{**FAST_FAILING, "breaker_cooldown_s": cooldown_s},
    )
    try:
        reader.flush()
        assert requests_made(proxy, reader.put, [(key_for("first-refused"), VALUES[0])])[1] == {"PUT": 1}
        time.sleep(2 * cooldown_s)  # (past the cool-down: the next put is the one sent)
        batch = [(key_for(f"due-{i}"), VALUES[0]) for i in range(8)]
        made = requests_made(proxy, reader.put, batch)[1]
        assert made == {"PUT": 1}, made
        assert reader.stats().extra["breaker_state"] == "closed", reader.stats().extra
    finally:
        reader.close()
        proxy.close()


def test_a_credential_that_may_not_write_keeps_serving_reads(seaweed_s3: SeaweedS3, caplog) -> None:
    """Read and list allowed, write denied (AccessDenied on each PUT): stores are dropped and
    counted, one refused PUT per cool-down, and the records the store holds still hit
    (9729927: the refusals opened the tier's breaker, and every lookup missed)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    writer = make_s3_tier(seaweed_s3.endpoint, prefix)
    writer.put(list(zip(KEYS, VALUES)))
    writer.flush()
    writer.close()
    proxy = FaultProxy(seaweed_s3.port)
    reader = make_s3_tier(
        proxy.endpoint,
        prefix,
        access_key_id=READ_ONLY_ACCESS_KEY,
        secret_access_key=READ_ONLY_SECRET_KEY,
        **FAST_FAILING,
        breaker_cooldown_s=60.0,
    )
    try:
        reader.flush()
        puts = 2 * FAST_FAILING["breaker_failures"]
        made = [requests_made(proxy, reader.put, [(key_for(f"refused-{i}"), VALUES[0])])[1] for i in range(puts)]
        assert [None if v is None else bytes(v) for v in reader.get(KEYS)] == VALUES, reader.stats().extra
        extra = reader.stats().extra
        assert extra["breaker_state"] == "closed" and extra["dropped_puts"] == puts, extra
        assert made == [{"PUT": 1}] + [{}] * (puts - 1)  # then refused without a request until the cool-down
        assert "refuses writes" in caplog.text and "AccessDenied" in caplog.text, caplog.text
        # told apart from failures, in stats and in the metric an operator alerts on
        assert extra["refused_puts"] == puts, extra
        metrics = reader.context.metrics
        assert metrics.value("kvplug_remote_refused_writes_total", tier=f"{reader.context.tier_index}:s3") == puts
    finally:
        reader.close()
        proxy.close()


def test_a_proxy_that_forbids_puts_keeps_reads_hitting(s3_server: MotoS3 | SeaweedS3, caplog) -> None:
    """A proxy or gateway in front of the store answers each PUT a plain ``403 Forbidden``
    (no S3 error code): stores are dropped and counted, one PUT is sent per cool-down, and
    the records the store holds still hit (ee9bb23: the 403s opened the tier's breaker, and
    every lookup missed for a cool-down)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    writer = make_s3_tier(s3_server.endpoint, prefix)
    writer.put(list(zip(KEYS, VALUES)))
    writer.flush()
    writer.close()
    proxy = FaultProxy(s3_server.port)
    reader = make_s3_tier(proxy.endpoint, prefix, **FAST_FAILING, breaker_cooldown_s=60.0)
    try:
        reader.flush()
        proxy.set_mode("forbid_puts")
        puts = 2 * FAST_FAILING["breaker_failures"]
        for i in range(puts):
            reader.put([(key_for(f"forbidden-{i}"), VALUES[0])])
        assert [None if v is None else bytes(v) for v in reader.get(KEYS)] == VALUES, reader.stats().extra
        extra = reader.stats().extra
        assert extra["breaker_state"] == "closed" and extra["dropped_puts"] == puts, extra
        assert proxy.forbidden == 1  # then refused without a request until the cool-down
        assert "refuses writes" in caplog.text and "403" in caplog.text, caplog.text
    finally:
        reader.close()
        proxy.close()


@contextlib.contextmanager
def unwritable(folders: list[Path]) -> Iterator[None]:
    """``folders`` refuse new files: by their mode, or for root (whom no mode stops) by the
    immutable flag (EPERM)."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", *map(str, folders)], check=True)
    else:
        for folder in folders:
            folder.chmod(0o555)
    try:
        yield
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", *map(str, folders)], check=True)
        else:
            for folder in folders:
                folder.chmod(0o755)


def test_a_folder_that_may_not_be_written_keeps_serving_reads(tmp_path: Path, caplog) -> None:
    """``file://`` (the threaded driver) on a folder this process may not write: stores are
    dropped and counted, writes wait a cool-down, and the records there still hit
    (ee9bb23: PermissionError was the tier's failure, its breaker opened, and every lookup
    missed)."""
    caplog.set_level(logging.WARNING, logger="kvplug.tier")
    store = tmp_path / "store"
    writer = S3Tier(S3Tier.Config(url=f"file://{store}"), tier_context())
    writer.put(list(zip(KEYS, VALUES)))
    writer.close()
    options = {"retries": 0, "breaker_failures": 3, "breaker_cooldown_s": 60.0}
    reader = S3Tier(S3Tier.Config(url=f"file://{store}", **options), tier_context())
    try:
        reader.flush()
        puts = 2 * options["breaker_failures"]
        with unwritable([store, *store.iterdir()]):
            for i in range(puts):
                reader.put([(key_for(f"refused-{i}"), VALUES[0])])
            assert [None if v is None else bytes(v) for v in reader.get(KEYS)] == VALUES, reader.stats().extra
        # Writable again, but within the cool-down: refused without an attempt.
        reader.put([(key_for("in-cool-down"), VALUES[0])])
        extra = reader.stats().extra
        assert extra["breaker_state"] == "closed" and extra["dropped_puts"] == puts + 1, extra
        assert reader.get([key_for("in-cool-down")]) == [None]
        assert "refuses writes" in caplog.text and "PermissionError" in caplog.text, caplog.text
    finally:
        reader.close()


def test_refused_connections_open_the_breaker() -> None:
    tier = make_s3_tier(f"http://127.0.0.1:{free_port()}", **FAST_FAILING, breaker_cooldown_s=60.0)
    try:
        assert_fails_then_costs_nothing(tier, None)
    finally:
        tier.close()


def test_seaweedfs_listens_on_loopback_only(seaweed_s3: SeaweedS3) -> None:
    assert seaweed_s3.process is not None
    found = listening_addresses(seaweed_s3.process.pid)
    assert {port for _, port in found} >= set(seaweed_s3.ports.values()), (found, seaweed_s3.ports)
    assert all(address == "127.0.0.1" for address, _ in found), found
