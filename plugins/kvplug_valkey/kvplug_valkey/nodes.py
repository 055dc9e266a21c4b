"""Pipelines to a Valkey/Redis cluster, one per node, each node behind a circuit breaker of its own.

A sharded cluster whose node dies still serves the keys on its other nodes. valkey-py's
cluster pipeline fails as a whole when one node does not answer (and then drops every
node's connections to rediscover the cluster), so one dead node would fail every batch
and open the tier's breaker: keys on healthy nodes would miss too. Here the cluster
client only keeps the map of slots to nodes (:mod:`kvplug_valkey.slot_map` reads it, within
the batch's deadline) and sends nothing: a listing scans each node over a plain client of that
node, and each node's share of a batch goes as one pipeline over it, under the node's own
:class:`kvplug.CircuitBreaker` (the tier's ``breaker_failures`` and
``breaker_cooldown_s``). The keys of a node that fails, or whose breaker is open, get a
:class:`NodeDownError` in their slots: no answer for those keys alone, a miss, never a
failure of the whole batch. A resharding moves slots between nodes: a key whose node
answers ``MOVED`` (its slot moved) or ``ASK`` (its slot half-way, the key moved already)
is sent once more in the same batch to the node named; a node the map lacks (one that just
joined) makes the batch read the map once, and one still unknown is a miss. After ``MOVED`` the
map is read before the next batch (from the nodes in turn: a hung one does not stop it); the
clients and breakers of nodes that left it are dropped then, and a call on its way to one is
not retried. Only when no node answers does the batch fail, for the tier's retries and breaker.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from valkey import exceptions as vex

from kvplug import CircuitBreaker, OpeningWarnings
from kvplug.errors import TierUnavailableError
from kvplug_valkey import redirects
from kvplug_valkey.slot_map import SlotMap

_log = logging.getLogger("kvplug.tier")
#: A node's share of a batch ends at this fraction of the attempt's deadline, so that the
#: other nodes' answers still reach the tier when one node hangs.
NODE_DEADLINE_SHARE = 0.8
#: Refusals of the credentials, which no retry fixes (:func:`kvplug_valkey.failures.classify`
#: makes them permanent).
CREDENTIAL_ERRORS = (vex.AuthenticationError, vex.AuthorizationError, vex.NoPermissionError)


def is_standalone_server(error: BaseException | None) -> bool:
    """Whether ``error``, a node's answer to a reading of the map, says it is no cluster node
    (``cluster: true`` given for a standalone server: permanent, see ``failures.classify``)."""
    return error is not None and "Cluster mode is not enabled" in str(error)


class NodeDownError(TierUnavailableError):
    """A cluster node did not answer for this key (failed, breaker open, slot moved)."""


def _key_of(command: tuple[Any, ...]) -> Any:
    """The key a command acts on: ``EVAL script 1 KEY ...`` or ``COMMAND KEY ...``."""
    return command[3] if command[0] == "EVAL" else command[1]


def _commands(commands: Sequence[tuple[Any, ...]], positions: list[int], asking: bool) -> list[tuple[Any, ...]]:
    """The commands at ``positions``; with ``asking``, each after ``ASKING`` (which lets the next
    command of the connection into a slot being imported)."""
    chosen = [commands[i] for i in positions]
    return [part for command in chosen for part in (("ASKING",), command)] if asking else chosen


class ClusterNodes:
    """Per-node pipelines and breakers over a ``ValkeyCluster`` client's slot map; see the module docstring."""

    def __init__(
        self,
        cluster: Any,
        node_client: Callable[[str, int], Any],
        *,
        breaker_failures: int,
        breaker_cooldown_s: float,
        request_timeout_s: float,
        retries: int,
        tls: bool = False,
        on_failure: Callable[[BaseException], None] = lambda exc: None,
        on_short_circuit: Callable[[], None] = lambda: None,
    ) -> None:
        self._node_client = node_client
        self._failures = breaker_failures
        self._cooldown_s = breaker_cooldown_s
        self._node_timeout_s = request_timeout_s * NODE_DEADLINE_SHARE
        self._retries = retries
        #: Report a node's failed call, and a call its open breaker answered, to the tier's metrics.
        self._on_failure = on_failure
        self._on_short_circuit = on_short_circuit
        self._breakers: dict[str, CircuitBreaker] = {}
        self._clients: dict[str, Any] = {}
        self._map = SlotMap(cluster, self._client_of, self._forget_departed, tls=tls)
        #: Nodes whose last call failed (or was refused by their open breaker).
        self._failing: set[str] = set()
        #: Per node, the openings of its breaker said lately (a node down for good opens it
        #: after every cool-down, its probe failing: said once per 10 minutes, as the tier's).
        self._said: dict[str, OpeningWarnings] = {}
        #: Failed node pipelines (each also counts towards that node's breaker).
        self.failures = 0

    def describe(self) -> dict[str, int | float | str]:
        """``nodes``: primaries known; ``nodes_down``: those whose breaker is not closed."""
        # (Called from stats() on another thread: the map's primaries() is safe there.)
        primaries = {node.name for node in self._map.primaries()}
        breakers = list(self._breakers.items())
        down = sum(1 for name, breaker in breakers if name in primaries and breaker.state != "closed")
        return {"nodes": len(primaries), "nodes_down": down}

    async def pipeline(
        self, commands: Sequence[tuple[Any, ...]], raise_server_errors: Callable[[Sequence[Any]], None]
    ) -> list[Any]:
        """Each command's reply, or a :class:`NodeDownError` for those of nodes not answering."""
        loop = asyncio.get_running_loop()
        # (The map's reading, the nodes' calls and the redirected keys' second round, all within it.)
        deadline = loop.time() + self._node_timeout_s
        readings = self._map.readings
        await self._current_map(deadline)
        results: list[Any] = [None] * len(commands)
        groups: dict[str, tuple[Any, list[int]]] = {}
        for position, command in enumerate(commands):
            try:
                node = self._map.node_of(_key_of(command))
            except vex.SlotNotCoveredError as exc:
                self._map.stale = True
                results[position] = NodeDownError(str(exc))
                continue
            groups.setdefault(node.name, (node, []))[1].append(position)
        sends = [(node, positions, False) for node, positions in groups.values()]
        failed = await self._send(sends, commands, results, raise_server_errors, deadline, redirected=False)
        if failed and len(failed) == len(groups) and self._none_answering():
            raise failed[0]  # the whole cluster: the tier's retries and breaker judge it
        # Slots being moved: a key told MOVED (its slot moved) or ASK (its slot half-way, the key
        # moved) is sent once more, to the node named (after ASKING for ASK). A node the map lacks
        # (one that just joined) makes the batch read the map, unless a reading began since the
        # batch did; a node still unknown is a miss: nothing goes where only a reply points.
        targets = [redirects.target(result) for result in results]
        if any(t is not None and self._map.known(t[0]) is None for t in targets):
            await self._map.read_members(deadline, unless_since=readings)
        redirected: dict[tuple[str, bool], tuple[Any, list[int]]] = {}
        for position, target in enumerate(targets):
            node = None if target is None else self._map.known(target[0])
            if target is not None and node is not None:
                redirected.setdefault((node.name, target[1]), (node, []))[1].append(position)
        sends = [(node, positions, asking) for (_, asking), (node, positions) in redirected.items()]
        await self._send(sends, commands, results, raise_server_errors, deadline, redirected=True)
        return [NodeDownError(f"slot moved: {r}") if redirects.redirected(r) else r for r in results]

    async def keys(self, match: bytes, count: int) -> list[bytes]:
        """The keys matching ``match`` on every primary of the map (``SCAN`` over each node's own
        client: valkey-py's cluster client drops a node that fails from those it reads the map
        from, then reads it by itself, with no deadline), and on every online primary ``CLUSTER
        SHARDS`` names that the map lacks (one that joined holds the keys of the slot it
        imports, moved already). A node that fails fails the listing, at once where its breaker
        is open (a hung node would hold it for its timeout)."""
        deadline = asyncio.get_running_loop().time() + self._node_timeout_s
        await self._current_map(deadline)
        await self._map.read_members(deadline)
        found: dict[bytes, None] = {}
        for node in [*self._map.primaries(), *self._map.joined()]:
            client, breaker = self._client(node), self._breaker(node.name)
            if not breaker.allow():
                self._on_short_circuit()
                raise NodeDownError(f"cluster node {node.name}: circuit breaker open, the listing cannot scan it")
            try:  # (the scan is the probe of a half-open breaker: its outcome is recorded)
                async for key in client.scan_iter(match=match, count=count):
                    found[key] = None  # (a key whose slot moved during the listing is met twice)
            except Exception as exc:
                if self._map.known(node.name) is not None:  # (else it left the map meanwhile, not failing)
                    self._failed(node.name, breaker, exc)
                raise
            self._answered(node.name, breaker)
        return list(found)

    async def _current_map(self, deadline: float) -> None:
        """Read the map if it is stale; raise when no node ever gave one (none answers)."""
        if await self._map.current(deadline):
            return
        error = self._map.error
        if isinstance(error, CREDENTIAL_ERRORS):  # (a wrong password: said as such, and never retried)
            raise error.with_traceback(None)
        hint = (
            "; it is a standalone server: set cluster: false, or leave it unset" if is_standalone_server(error) else ""
        )
        raise NodeDownError(f"no cluster node gave the map of slots (the last: {error!r}){hint}") from error

    async def _send(
        self,
        sends: list[tuple[Any, list[int], bool]],
        commands: Sequence[tuple[Any, ...]],
        results: list[Any],
        raise_server_errors: Callable[[Sequence[Any]], None],
        deadline: float,
        *,
        redirected: bool,
    ) -> list[BaseException]:
        """Send each ``(node, positions, asking)`` its commands at once (``asking``: each after
        ``ASKING``), their replies (a :class:`NodeDownError` where the node failed) into ``results``;
        the nodes' failures. ``redirected``: the keys a redirection named these nodes for."""
        outcomes = await asyncio.gather(
            *(
                self._node(node, _commands(commands, positions, asking), raise_server_errors, deadline, redirected)
                for node, positions, asking in sends
            ),
            return_exceptions=True,
        )
        failed: list[BaseException] = []
        for (node, positions, asking), outcome in zip(sends, outcomes):
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):  # cancelled: the call's deadline, not the node's
                    raise outcome
                failed.append(outcome)
                down = (
                    outcome
                    if isinstance(outcome, NodeDownError)
                    else NodeDownError(f"cluster node {node.name}: {outcome}")
                )
                for position in positions:
                    results[position] = down
                continue
            for position, result in zip(positions, outcome[1::2] if asking else outcome):
                results[position] = result
        return failed

    async def _forget_departed(self) -> None:
        """Close the clients, and forget the breakers, of nodes no longer in the map (removed
        from the cluster: their sockets would stay open, their breakers kept, for good)."""
        for name in [name for name in self._breakers if self._map.known(name) is None]:
            del self._breakers[name]
            self._failing.discard(name)
            self._said.pop(name, None)
        departed = [self._clients.pop(name) for name in list(self._clients) if self._map.known(name) is None]
        for client in departed:  # (a call still on one fails: a miss for its keys, as for a node gone)
            await client.aclose()

    def _none_answering(self) -> bool:
        """No primary is known to answer: the last call to each one failed."""
        return all(node.name in self._failing for node in self._map.primaries())

    def _client(self, node: Any) -> Any:
        """``node``'s client, made on first use; refused (:class:`NodeDownError`) once the map no
        longer has the node: a reading closed its client then, and a retry still on its way
        would open a connection again, that nothing would ever close."""
        if self._map.known(node.name) is None:
            raise NodeDownError(f"cluster node {node.name}: no longer in the cluster's map")
        return self._client_of(node)

    def _client_of(self, node: Any) -> Any:
        """``node``'s client, made on first use (also the URL's node, for the first reading of the
        map: closed after it if the map lacks it)."""
        client = self._clients.get(node.name)
        if client is None:
            client = self._clients[node.name] = self._node_client(node.host, node.port)
        return client

    def _breaker(self, name: str) -> CircuitBreaker:
        breaker = self._breakers.get(name)
        if breaker is None:
            breaker = self._breakers[name] = CircuitBreaker(self._failures, self._cooldown_s)
        return breaker

    async def _node(
        self,
        node: Any,
        commands: list[tuple[Any, ...]],
        raise_server_errors: Callable[[Sequence[Any]], None],
        deadline: float,
        redirected: bool,
    ) -> list[Any]:
        self._client(node)  # (a node the map dropped meanwhile: refused before a breaker is made for it)
        breaker = self._breaker(node.name)
        if not breaker.allow():
            self._failing.add(node.name)
            self._on_short_circuit()
            raise NodeDownError(f"cluster node {node.name}: circuit breaker open")
        loop = asyncio.get_running_loop()
        try:
            for attempt in range(self._retries + 1):
                pipe = self._client(node).pipeline(transaction=False)
                for command in commands:
                    pipe.execute_command(*command)
                try:
                    results = await asyncio.wait_for(pipe.execute(raise_on_error=False), deadline - loop.time())
                    raise_server_errors([r for r in results if not redirects.redirected(r)])
                    break
                except (vex.ConnectionError, vex.TimeoutError):
                    # A blip (a connection refused or slow to open on a busy host) is retried
                    # within the node's share of the deadline, as the tier retries a batch.
                    if attempt == self._retries or not breaker.may_retry() or loop.time() >= deadline:
                        raise
        except NodeDownError:
            raise  # the node left the map during the call: a miss, not the node failing
        except Exception as exc:
            if self._map.known(node.name) is None:  # (it left during the call, its client closed under it)
                raise NodeDownError(f"cluster node {node.name}: left the cluster's map") from exc
            if redirected and isinstance(exc, (asyncio.TimeoutError, vex.TimeoutError)):
                # Redirected keys get what the first round left of the deadline, nothing where
                # another node hung for all of it: a miss for them, not this node failing (its
                # breaker opened by a hung peer: every key of its own missed).
                raise NodeDownError(f"cluster node {node.name}: no time left for keys redirected to it") from exc
            self._failed(node.name, breaker, exc)
            raise
        if any(redirects.map_outdated(r) for r in results):
            self._map.stale = True
        self._answered(node.name, breaker)
        return list(results)

    def _failed(self, name: str, breaker: CircuitBreaker, exc: BaseException) -> None:
        """Count a failed call of node ``name`` (the metrics, its breaker)."""
        self.failures += 1
        self._failing.add(name)
        self._on_failure(exc)
        if breaker.record_failure():
            self._map.stale = True  # a failover may have given its slots to another node
            again = self._said.setdefault(name, OpeningWarnings()).due(exc)
            if again is None:
                return
            _log.warning(
                "valkey cluster node %s is failing (%s: %s); its keys miss for %.1f s, the other nodes serve%s",
                name,
                type(exc).__name__,
                exc,
                self._cooldown_s,
                f" (it opened {again} time(s) more since the last line)" if again else "",
            )

    def _answered(self, name: str, breaker: CircuitBreaker) -> None:
        self._failing.discard(name)
        if breaker.record_success():
            self._said.pop(name, None)
            _log.warning("valkey cluster node %s answers again; its breaker closed", name)

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            await client.aclose()
        await self._map.close()
