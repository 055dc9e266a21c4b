"""RemoteCalls against real sockets on 127.0.0.1: a server that accepts and never
answers, a port that refuses, and the same server answering again.

The operation is a real asyncio TCP exchange (connect, send a line, read a line),
so deadlines, budgets, the breaker and the metrics are checked against the network,
not against a fake clock (tests/test_remote.py covers the state machine on one).
"""

from __future__ import annotations

import asyncio
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from kvplug import RemoteTierConfig
from kvplug.core.remote.calls import RemoteCalls, call_budget
from kvplug.errors import TierUnavailableError
from kvplug.testing import tier_context

#: Scheduling slack on a loaded 2-core CI machine, added to every bound.
MARGIN_S = 0.4


class LineServer:
    """A TCP server on 127.0.0.1. ``hang``: accepts, reads, never answers; ``answer``:
    replies ``pong`` to each line. Counts accepted connections."""

    def __init__(self) -> None:
        self.mode = "hang"
        self.accepted = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._connections: list[socket.socket] = []
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, name="line-server", daemon=True).start()

    def _accept(self) -> None:
        while not self._stopped:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                self._connections.append(connection)
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                while data := connection.recv(4096):
                    if self.mode == "answer":
                        connection.sendall(b"pong\n" * data.count(b"\n"))
            except OSError:
                return

    def close(self) -> None:
        self._stopped = True
        self._listener.close()
        with self._lock:
            for connection in self._connections:
                try:
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                connection.close()


def refused_port() -> int:
    """A loopback port nothing listens on (connecting to it is refused)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def ping(port: int):
    async def operation() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"ping\n")
            await writer.drain()
            return await reader.readline()
        finally:
            writer.close()

    return operation


CONFIG = RemoteTierConfig(
    request_timeout_s=0.5,
    retries=1,
    backoff_base_s=0.01,
    backoff_max_s=0.02,
    breaker_failures=2,
    breaker_cooldown_s=1.0,
)


@pytest.fixture
def server() -> Iterator[LineServer]:
    line_server = LineServer()
    yield line_server
    line_server.close()


@pytest.fixture
def calls() -> Iterator[RemoteCalls]:
    remote = RemoteCalls("probe", CONFIG, tier_context())
    yield remote
    remote.close()


def sample(calls: RemoteCalls, name: str, **labels: str) -> float:
    value = calls.context.metrics.registry.get_sample_value(name, {"tier": calls.label, **labels})
    return value or 0.0


def timed_failure(call) -> float:
    started = time.monotonic()
    with pytest.raises(TierUnavailableError):
        call()
    return time.monotonic() - started


def open_breaker(calls: RemoteCalls, port: int) -> None:
    for _ in range(CONFIG.breaker_failures):
        with pytest.raises(TierUnavailableError):
            calls.run(ping(port))
    assert calls.breaker.state == "open"


def test_a_call_to_a_hung_server_returns_within_its_deadline(server: LineServer, calls: RemoteCalls) -> None:
    worst = calls.policy.worst_case_s()  # two attempts of 0.5 s and one backoff
    seconds = timed_failure(lambda: calls.run(ping(server.port)))
    assert CONFIG.request_timeout_s <= seconds < worst + MARGIN_S
    assert server.accepted == 2  # the attempt and its one retry
    assert sample(calls, "kvplug_remote_failures_total", kind="timeout") == 2
    assert sample(calls, "kvplug_remote_retries_total") == 1


def test_a_budget_ends_the_wait_not_the_operation(server: LineServer, calls: RemoteCalls) -> None:
    with call_budget(0.05):
        seconds = timed_failure(lambda: calls.run(ping(server.port)))
    assert seconds < 0.05 + MARGIN_S
    # The operation goes on under its own deadline, so a hung store is still counted
    # as failing (and would open the breaker) although the caller stopped waiting.
    stop = time.monotonic() + calls.policy.worst_case_s() + 2 * MARGIN_S
    while (
        sample(calls, "kvplug_remote_failures_total", kind="timeout") < 2 or calls.breaker.state != "open"
    ) and time.monotonic() < stop:
        time.sleep(0.02)
    assert sample(calls, "kvplug_remote_failures_total", kind="timeout") == 2
    assert calls.breaker.state == "open"


def test_a_batch_answers_by_the_budget(server: LineServer, calls: RemoteCalls) -> None:
    async def echo(argument: int) -> int:
        await ping(server.port)()
        return argument

    started = time.monotonic()
    with call_budget(0.1):
        results = calls.batch(echo, range(8))
    seconds = time.monotonic() - started
    assert seconds < 0.1 + MARGIN_S
    assert all(isinstance(result, TierUnavailableError) for result in results), results


def test_a_budget_already_spent_short_circuits(calls: RemoteCalls) -> None:
    with call_budget(0.0):
        assert calls.allow(3) is False
    assert sample(calls, "kvplug_remote_short_circuits_total") == 3
    assert calls.allow() is True  # outside the budget the store is asked again


def test_refused_connections_are_failures_that_open_the_breaker(calls: RemoteCalls) -> None:
    port = refused_port()
    seconds = timed_failure(lambda: calls.run(ping(port)))
    assert seconds < CONFIG.request_timeout_s  # refused is immediate, not a timeout
    assert sample(calls, "kvplug_remote_failures_total", kind="ConnectionRefusedError") == 2
    assert calls.breaker.state == "open"
    assert sample(calls, "kvplug_remote_breaker_state") == 2.0


def test_an_open_breaker_costs_under_a_millisecond_and_no_connection(server: LineServer, calls: RemoteCalls) -> None:
    assert sample(calls, "kvplug_remote_breaker_state") == 0.0
    open_breaker(calls, server.port)
    assert sample(calls, "kvplug_remote_breaker_state") == 2.0
    accepted = server.accepted
    costs = []
    for _ in range(200):
        started = time.perf_counter()
        allowed = calls.allow()
        costs.append(time.perf_counter() - started)
        assert allowed is False
    assert statistics.median(costs) < 0.001 and sum(costs) / len(costs) < 0.001, max(costs)
    assert server.accepted == accepted, "an open breaker must not connect"
    assert sample(calls, "kvplug_remote_short_circuits_total") == 200
    assert calls.short_circuited == 200


def test_recovery_after_the_cool_down(server: LineServer, calls: RemoteCalls) -> None:
    open_breaker(calls, server.port)
    server.mode = "answer"
    assert calls.allow() is False  # still cooling down: the store is not asked
    time.sleep(CONFIG.breaker_cooldown_s + 0.05)
    assert calls.allow() is True and calls.breaker.state == "half_open"
    assert sample(calls, "kvplug_remote_breaker_state") == 1.0
    assert calls.allow() is False  # one probe at a time
    assert calls.run(ping(server.port)) == b"pong\n"
    assert calls.breaker.state == "closed" and calls.allow() is True
    assert sample(calls, "kvplug_remote_breaker_state") == 0.0
    assert calls.batch(lambda _: ping(server.port)(), range(4)) == [b"pong\n"] * 4


def test_a_failed_probe_opens_the_breaker_again(calls: RemoteCalls) -> None:
    port = refused_port()
    open_breaker(calls, port)
    time.sleep(CONFIG.breaker_cooldown_s + 0.05)
    assert calls.allow() is True
    with pytest.raises(TierUnavailableError):
        calls.run(ping(port))
    assert calls.breaker.state == "open" and calls.breaker.opens == 2
    assert calls.allow() is False


def test_operations_queued_behind_a_hung_store_are_not_sent_once_the_breaker_opens(server: LineServer) -> None:
    """Two slots, ten operations: the first ones hang and open the breaker; those that
    waited for a slot are answered without a connection, so a later probe does not
    queue behind them."""
    config = CONFIG.model_copy(update={"max_concurrency": 2, "retries": 0, "breaker_failures": 2})
    calls = RemoteCalls("probe", config, tier_context())
    try:

        async def echo(argument: int) -> int:
            await ping(server.port)()
            return argument

        results = calls.batch(echo, range(10))
        assert all(isinstance(result, TierUnavailableError) for result in results), results
        assert calls.breaker.state == "open"
        # Until the second failure opens the breaker, a slot freed by the first one may
        # still send one more operation (timeouts end at slightly different moments on a
        # loaded machine): at most max_concurrency + breaker_failures - 1 connections.
        assert 2 <= server.accepted <= 3, server.accepted
        assert sample(calls, "kvplug_remote_short_circuits_total") == 10 - server.accepted
    finally:
        calls.close()
