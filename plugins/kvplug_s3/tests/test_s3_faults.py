"""A store that is down, slow, hung, cutting connections or answering 503: requests
still get answers (misses) within a bound, the breaker opens and stops network
traffic, and the tier recovers by itself when the fault goes away. On moto and on
SeaweedFS.

The set-up (writing and reading back the values before the fault) runs with the
normal deadlines, through a tier of its own: a loaded 2-core CI machine must not
turn the set-up into a failure. Only the faulted tier has the FAST_FAILING ones.
"""

from __future__ import annotations

import statistics
import time
import uuid
from collections.abc import Iterator

import pytest
import torch  # the engine test needs torch; the tier itself does not

from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, PluginRegistry, load_config
from kvplug.testing import key_for, value_for
from kvplug_s3 import S3Tier
from kvplug_s3.testing import FAST_FAILING, FaultProxy, MotoS3, SeaweedS3, free_port, make_s3_tier, s3_options

#: The engine format this test's caches use, as the vLLM/SGLang adapters declare it (same name: same fingerprints).
VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))

#: "Returns instead of hanging": far above the configured deadlines (1 s per attempt).
ANSWER_BOUND_S = 10.0
#: Scheduling slack on a loaded 2-core machine, added to the lookup budget.
LOOKUP_MARGIN_S = 0.6  # a lookup that waited for the proxy would take 5 s
KEYS = [key_for(f"fault-{i}") for i in range(6)]
VALUES = [value_for(f"fault-{i}", 20_000 + i) for i in range(6)]


@pytest.fixture
def proxy(s3_server: MotoS3 | SeaweedS3) -> Iterator[FaultProxy]:
    fault_proxy = FaultProxy(s3_server.port, delay_s=5.0)
    yield fault_proxy
    fault_proxy.close()


def seeded_prefix(endpoint: str) -> str:
    """A fresh prefix holding KEYS/VALUES, written and read back with normal deadlines."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    seeder = make_s3_tier(endpoint, prefix)
    try:
        seeder.put(list(zip(KEYS, VALUES)))
        assert [None if v is None else bytes(v) for v in seeder.get(KEYS)] == VALUES, seeder.stats()
    finally:
        seeder.close()
    return prefix


def timed(call, *args):
    started = time.monotonic()
    result = call(*args)
    return result, time.monotonic() - started


def wait_for_hits(tier: S3Tier, deadline_s: float = 40.0) -> list:
    """Read until every key hits again (the breaker's probe must get through)."""
    stop = time.monotonic() + deadline_s
    while True:
        got = tier.get(KEYS)
        if all(v is not None for v in got) or time.monotonic() > stop:
            return got
        time.sleep(0.2)


def assert_store_down_behaviour(tier: S3Tier, traffic) -> None:
    """Misses within the bound, breaker open, and no traffic while it is open."""
    for _ in range(3):  # the first call pays the failing attempts; later ones are short-circuited
        got, seconds = timed(tier.get, KEYS)
        assert got == [None] * len(KEYS), tier.stats()
        assert seconds < ANSWER_BOUND_S, tier.stats()
    # The cool-down (3 s) is long against these calls (milliseconds once open).
    before = (traffic(), tier.stats().extra)
    assert before[1]["breaker_state"] == "open" and before[1]["breaker_opens"] >= 1, before[1]
    assert tier.contains(KEYS) == [False] * len(KEYS)
    tier.put([(key_for("during-fault"), b"x" * 100)])
    after = tier.stats().extra
    assert after["dropped_puts"] == before[1]["dropped_puts"] + 1
    assert after["short_circuited"] >= before[1]["short_circuited"] + len(KEYS)
    assert traffic() == before[0], "an open breaker must not touch the network"


def assert_recovers(tier: S3Tier, deadline_s: float = 40.0) -> None:
    got = wait_for_hits(tier, deadline_s)
    assert [None if v is None else bytes(v) for v in got] == VALUES, tier.stats()
    assert tier.stats().extra["breaker_state"] == "closed", tier.stats()
    # A new write and read; the fast deadlines may still lose one to a loaded machine.
    stop = time.monotonic() + deadline_s
    while True:
        tier.put([(key_for("after-fault"), b"back" * 100)])
        value = tier.get([key_for("after-fault")])[0]
        if value is not None or time.monotonic() > stop:
            break
        time.sleep(0.2)
    assert value is not None and bytes(value) == b"back" * 100, tier.stats()


@pytest.mark.parametrize("fault", ["delay", "cut", "refuse", "http503", "hang"])
def test_network_fault_gives_misses_opens_the_breaker_and_recovers(fault: str, proxy: FaultProxy) -> None:
    prefix = seeded_prefix(proxy.endpoint)
    tier = make_s3_tier(proxy.endpoint, prefix, **FAST_FAILING, breaker_cooldown_s=3.0, scan_on_start=False)
    try:
        proxy.set_mode(fault)
        assert_store_down_behaviour(tier, lambda: (proxy.connections, proxy.forwarded_bytes))
        proxy.set_mode("pass")
        assert_recovers(tier)
    finally:
        tier.close()


def restartable_server(kind: str, tmp_path) -> MotoS3 | SeaweedS3:
    # A server of its own, so stopping it does not disturb other tests (moto's objects
    # live in this process, SeaweedFS's in tmp_path: both survive the restart).
    if kind == "moto":
        moto = MotoS3()
        moto.start()
        moto.client().create_bucket(Bucket=s3_options("")["url"].split("/")[2])
        return moto
    seaweed = SeaweedS3(tmp_path)
    seaweed.start()
    return seaweed


@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_server_stopped_mid_run_then_restarted(kind: str, tmp_path) -> None:
    server = restartable_server(kind, tmp_path)
    prefix = seeded_prefix(server.endpoint)
    tier = make_s3_tier(server.endpoint, prefix, **FAST_FAILING, breaker_cooldown_s=3.0, scan_on_start=False)
    try:
        server.stop()  # SeaweedFS: SIGKILL of the whole server
        assert_store_down_behaviour(tier, lambda: 0)
        server.start()
        assert_recovers(tier, deadline_s=60.0)
    finally:
        tier.close()
        if isinstance(server, SeaweedS3):
            server.close()
        else:
            server.stop()


def test_unreachable_store_at_start_is_not_fatal() -> None:
    """Nothing listens on the endpoint when the tier starts: start-up, flush and
    every request still answer, as misses."""
    tier = make_s3_tier(f"http://127.0.0.1:{free_port()}", **FAST_FAILING, breaker_cooldown_s=60.0)
    try:
        _, seconds = timed(tier.flush)
        assert seconds < ANSWER_BOUND_S
        for _ in range(4):
            got, seconds = timed(tier.get, KEYS)
            assert got == [None] * len(KEYS) and seconds < ANSWER_BOUND_S
        tier.put([(KEYS[0], VALUES[0])])
        stats = tier.stats()
        assert stats.extra["breaker_state"] == "open"
        assert stats.extra["dropped_puts"] >= 1 and stats.items == 0
    finally:
        tier.close()


def test_a_slow_store_within_the_deadline_still_serves(s3_server: MotoS3 | SeaweedS3) -> None:
    """Slowness under the deadline is not a failure: values come back whole."""
    proxy = FaultProxy(s3_server.port, delay_s=0.2)
    prefix = seeded_prefix(proxy.endpoint)
    tier = make_s3_tier(proxy.endpoint, prefix, **{**FAST_FAILING, "read_timeout_s": 5.0, "request_timeout_s": 8.0})
    try:
        proxy.set_mode("delay")
        assert [None if v is None else bytes(v) for v in tier.get(KEYS)] == VALUES, tier.stats()
        assert tier.stats().extra["breaker_state"] == "closed"
    finally:
        tier.close()
        proxy.close()


# --- a hung store behind a whole CacheEngine ---------------------------------------

LAYOUT = KVLayout(VLLM_FLASH, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
LOOKUP_BUDGET_S = 0.2


def engine_on(s3: dict) -> CacheEngine:
    registry = PluginRegistry(plugin_filter="cpu,s3")
    extra = {
        "kvplug.chunk_size": 8,
        "kvplug.lookup_budget_s": LOOKUP_BUDGET_S,
        "kvplug.tiers": [{"type": "cpu", "max_bytes": "16MiB"}, {"type": "s3", **s3}],
    }
    config = load_config(engine_extra=extra, env={}, registry=registry).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="s3-hang"), registry=registry)


def test_a_hung_store_costs_a_lookup_its_budget_then_nothing(proxy: FaultProxy) -> None:
    """The S3 endpoint accepts connections and never answers: each lookup returns
    within lookup_budget_s (plus scheduling slack); once the breaker opened (the
    abandoned calls still time out and count), a lookup costs under a millisecond
    and sends nothing."""
    s3 = s3_options(proxy.endpoint, request_timeout_s=1.0, read_timeout_s=1.0, connect_timeout_s=0.5, retries=0)
    engine = engine_on({**s3, "breaker_failures": 3, "breaker_cooldown_s": 60.0, "scan_on_start": False})
    tokens = list(range(5000, 5032))  # 4 chunks, none cached: the cpu tier misses, s3 is asked
    try:
        proxy.set_mode("hang")
        stop = time.monotonic() + ANSWER_BOUND_S
        lookups = 0
        while True:
            hit, seconds = timed(engine.lookup, tokens)
            lookups += 1
            assert hit == 0 and seconds < LOOKUP_BUDGET_S + LOOKUP_MARGIN_S, (lookups, seconds)
            s3_stats = dict(engine.chain.stats())
            state = next(stats for label, stats in s3_stats.items() if label.endswith(":s3")).extra["breaker_state"]
            if state == "open" or time.monotonic() > stop:
                break
            time.sleep(0.05)
        assert state == "open", s3_stats
        connections = proxy.connections
        costs = [timed(engine.lookup, tokens)[1] for _ in range(50)]
        assert statistics.median(costs) < 0.001, costs
        assert proxy.connections == connections, "an open breaker must not connect"
    finally:
        engine.close()
