"""A Valkey/Redis cluster's map of slots to nodes, read here alone, each reading within a deadline.

The map is valkey-py's (its cluster client's nodes manager), but valkey-py's own reading has no
deadline: it asks the nodes one after another, the URL's first, each up to the socket timeout,
so a hung URL node would hold every reading past its deadline, for good. Here the nodes are
asked in turn, the one that answered last first, each within an equal part of what is left,
and each over the tier's client of that node (:class:`_Reader`). A reading that gets no map
keeps the old one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from valkey import exceptions as vex
from valkey.cluster import PRIMARY

from kvplug_valkey import shards

_log = logging.getLogger("kvplug.tier")
#: A reading of the slot map ends at this fraction of the nodes' deadline (the old map stays),
#: so that the batch that reads it still gets the nodes' answers when a node it asks hangs.
#: With no map yet, the batch has nothing to send without one: the reading gets all of it.
MAP_DEADLINE_SHARE = 0.5


class _Reader:
    """The one node valkey-py asks in a reading of the map (:meth:`SlotMap._read_from`),
    over the tier's client of that node: a reading sends one command on a connection open
    already. (valkey-py's own node objects, new at each reading, connected afresh each time:
    a TLS handshake and four round trips more, within the reading's share of a deadline.)"""

    def __init__(self, node: Any, client: Any) -> None:
        self.host, self.port, self.name = node.host, node.port, node.name
        self.execute_command = client.execute_command

    async def disconnect(self) -> None:
        """Nothing: the client is the tier's, closed with it or once its node leaves the map."""


class SlotMap:
    """The slot map of a ``ValkeyCluster`` client (which sends nothing itself); see the module
    docstring. ``client_of(node)``: the tier's client of a node, made on first use (the URL's
    node before the first map too); ``on_read``: awaited after each reading that got a map."""

    def __init__(
        self, cluster: Any, client_of: Callable[[Any], Any], on_read: Callable[[], Awaitable[None]], *, tls: bool
    ) -> None:
        self._manager = cluster.nodes_manager
        self._cluster = cluster
        self._client_of = client_of
        self._on_read = on_read
        self._tls = tls
        #: The map is to be read before the next batch (the first batch reads it: the tier's
        #: reading is the only one, under its deadline; valkey-py's has none).
        self.stale = True
        self._refreshing = asyncio.Lock()
        #: Readings of the map begun (a batch reads it at most once, and not after another batch did).
        self.readings = 0
        #: The node whose map the last reading took: the first one asked next time.
        self._last_good: str | None = None
        #: Every node of the last reading's ``CLUSTER SHARDS`` (a reading for a node the map lacks:
        #: one serving no slot, which ``CLUSTER SLOTS``, the map's nodes, leaves out), else none.
        self._members: dict[str, shards.Member] = {}
        #: Why the last node asked for the map gave none (said when no node ever gave one).
        self.error: BaseException | None = None

    def node_of(self, key: Any) -> Any:
        """The node serving ``key``'s slot (:class:`valkey.exceptions.SlotNotCoveredError` if none)."""
        return self._cluster.get_node_from_key(key)

    def known(self, address: str) -> Any:
        """The node at ``address`` if the last reading of the map named it (``CLUSTER SLOTS``,
        else ``CLUSTER SHARDS``), else ``None``."""
        return self._manager.nodes_cache.get(address) or self._members.get(address)

    def primaries(self) -> list[Any]:
        """The map's primaries. (Also called from stats() on another thread while the loop may
        read the map, which changes the node dict in place: one copy of it, as list() of a dict
        holds the GIL throughout, never a Python loop over the live dict.)"""
        return [node for node in list(self._manager.nodes_cache.values()) if node.server_type == PRIMARY]

    def joined(self) -> list[shards.Member]:
        """The online primaries the last ``CLUSTER SHARDS`` named that the map lacks (one that
        joined holds the keys of the slot it imports, moved already)."""
        return [m for m in self._members.values() if m.primary and m.name not in self._manager.nodes_cache]

    async def current(self, deadline: float) -> bool:
        """Read the map if it is stale; whether there is one (if not, :attr:`error` says why)."""
        if self.stale or self._refreshing.locked():
            # A batch that comes while another reads the map waits for the new map: the old
            # one would send it where the redirections came from.
            async with self._refreshing:
                if self.stale:
                    await self._read(deadline, members=False)
        if not self._manager.slots_cache:
            self.stale = True
            return False
        return True

    async def read_members(self, deadline: float, *, unless_since: int | None = None) -> None:
        """Read the map and every node (``CLUSTER SHARDS``, a round trip more), for a node the
        map lacks; not if a reading began after the ``unless_since``-th (another batch's)."""
        async with self._refreshing:
            if unless_since is None or self.readings == unless_since:
                await self._read(deadline, members=True)

    async def _read(self, deadline: float, *, members: bool) -> None:
        """Read the slot map again, within :data:`MAP_DEADLINE_SHARE` of what is left until
        ``deadline`` (a loop time), the rest being the nodes' (the old map stays if no node
        answers in time), each node asked within an equal part of it."""
        self.stale = False
        self.readings += 1
        loop = asyncio.get_running_loop()
        share = MAP_DEADLINE_SHARE if self._manager.slots_cache else 1.0
        until = loop.time() + (deadline - loop.time()) * share
        candidates = list(self._manager.startup_nodes.values())  # (valkey-py keeps the map's nodes there)
        candidates.sort(key=lambda node: node.name != self._last_good)
        for turn, node in enumerate(candidates):
            try:
                per_node = (until - loop.time()) / (len(candidates) - turn)
                self._members = await asyncio.wait_for(self._read_from(node, members), per_node)
            except (vex.ValkeyError, vex.ValkeyClusterException, OSError, asyncio.TimeoutError, IndexError) as exc:
                # (IndexError: valkey-py's reading of a node that answers an empty map, a node reset.)
                _log.debug("valkey cluster: no slot map from %s: %r", node.name, exc)
                # (valkey-py says why a node gave none in the cause of its own exception.)
                cause = exc.__cause__ if isinstance(exc, vex.ValkeyClusterException) else None
                self.error = cause or exc
                continue
            self._last_good = node.name
            await self._on_read()
            return

    async def _read_from(self, node: Any, members: bool) -> dict[str, shards.Member]:
        """With ``members`` the nodes ``CLUSTER SHARDS`` lists, then the map as ``node`` sees it
        (valkey-py's reading, asking ``node`` alone), both over the tier's client of ``node``."""
        client = self._client_of(node)
        try:
            found = shards.members(await client.execute_command("CLUSTER SHARDS"), self._tls) if members else {}
        except (vex.ResponseError, TypeError, ValueError, AttributeError):
            found = {}  # (no such command before Valkey/Redis 7, or a reply not as documented)
        manager = self._manager
        old = (manager.startup_nodes, dict(manager.nodes_cache), manager.slots_cache, manager.default_node)
        manager.startup_nodes = {node.name: _Reader(node, client)}
        try:
            await manager.initialize()  # (which sets startup_nodes to the map's nodes)
        except BaseException:  # (cancelled at the end of its share too)
            # The old map stays: valkey-py replaces it before it fails on an empty one (a node
            # reset). (It disconnected the old nodes: they connect again when next asked.)
            manager.startup_nodes, manager.nodes_cache, manager.slots_cache, manager.default_node = old
            raise
        return found

    async def close(self) -> None:
        """Close the map's nodes (valkey-py's aclose() closes them only after its own reading)."""
        await self._manager.aclose()
        await self._manager.aclose("startup_nodes")
