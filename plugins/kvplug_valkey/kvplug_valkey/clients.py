"""The valkey tier's clients, as its config makes them: a server's, a cluster's and a cluster
node's, each with kvplug's timeouts, TLS and credentials, and replies bounded by the record
bound (:mod:`kvplug_valkey.replies`)."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

import valkey.asyncio as avalkey
from valkey import exceptions as vex
from valkey.asyncio.cluster import ValkeyCluster

from kvplug_valkey.config import ValkeyTierConfig
from kvplug_valkey.replies import bound_cluster_replies, bound_replies, bounded_parser

Client = Any  # valkey.asyncio.Valkey | ValkeyCluster: their stubs share no protocol


class WrongModeError(ValueError):
    """The ``cluster`` option says the server is what it is not (a cluster node redirects
    with ``MOVED`` every key it does not own; a standalone server gives no map of slots):
    a misconfiguration no retry fixes (permanent, as a ``ValueError``)."""

    @classmethod
    def not_standalone(cls, where: str, evidence: str) -> WrongModeError:
        """``cluster: false`` for a server that ``evidence`` shows is a cluster node."""
        return cls(
            f"cluster: false, but {where} is a cluster node ({evidence}): "
            "set cluster: true, or leave it unset to ask the server"
        )

    @classmethod
    def cannot_ask(cls, where: str, refusal: Exception) -> WrongModeError:
        """``cluster`` unset, and the user may not run ``INFO`` (``refusal``), which tells a
        cluster node from a standalone server (a read-only ACL user often may not)."""
        return cls(
            f"cluster is unset, and {where} refuses the INFO that tells a cluster from a standalone server "
            f"({refusal}): set cluster: false (a standalone server) or true (a cluster), or allow the user +info"
        )


class ValkeyClients:
    """Makes the tier's clients from ``config``; ``record_bound``: the tier's ``max_record_bytes``
    (read at each reply), which bounds what a reply may announce."""

    def __init__(self, config: ValkeyTierConfig, record_bound: Callable[[], int | None]) -> None:
        self._config = config
        self._address = config.address
        self._parser = bounded_parser(record_bound)

    def _common(self) -> dict[str, Any]:
        config = self._config
        options: dict[str, Any] = {
            "username": config.username,
            "password": None if config.password is None else config.password.get_secret_value(),
            "socket_timeout": config.request_timeout_s,
            "socket_connect_timeout": config.connect_timeout_s,
            "decode_responses": False,
            "client_name": "kvplug",
        }
        if self._address.tls:
            options["ssl"] = True
            options["ssl_cert_reqs"] = "required"
            options["ssl_check_hostname"] = True
            if config.tls_ca_file is not None:
                options["ssl_ca_certs"] = config.tls_ca_file
            options["ssl_min_version"] = ssl.TLSVersion.TLSv1_2
        return options

    def standalone(self) -> Client:
        """A client of the one server the URL names."""
        if self._address.unix_path is not None:
            where: dict[str, Any] = {"unix_socket_path": self._address.unix_path}
        else:
            where = {"host": self._address.host, "port": self._address.port}
        # valkey-py's own retries stay off (its default): kvplug's policy retries within its deadline.
        client = avalkey.Valkey(
            **where, db=self._address.db, max_connections=self._config.max_connections, **self._common()
        )
        return bound_replies(client, self._parser)

    def node(self, host: str, port: int) -> Client:
        """A plain client of one cluster node (its share of each batch goes over it)."""
        client = avalkey.Valkey(host=host, port=port, max_connections=self._config.max_connections, **self._common())
        return bound_replies(client, self._parser)

    def cluster(self) -> Client:
        """A cluster client, of which the tier uses only the slot map (:mod:`kvplug_valkey.slot_map`
        reads it, each node within a deadline; batches and listings go over :meth:`node` clients):
        it never sends a command itself, nor reads its map, nor ``COMMAND`` from a node."""
        cluster = ValkeyCluster(
            host=self._address.host,
            port=self._address.port,
            max_connections=self._config.max_connections,
            require_full_coverage=False,
            **self._common(),
        )
        return bound_cluster_replies(cluster, self._parser)

    async def cluster_enabled(self, *, trust_config: bool) -> bool | None:
        """Whether the server says it is a cluster node (``INFO cluster``), over a client of its
        own. ``None`` when the config names the mode (``trust_config``) and the user may not run
        ``INFO`` (an ACL): the config is taken at its word."""
        probe = self.standalone()
        try:
            info = await probe.info("cluster")
        except vex.NoPermissionError:
            if not trust_config:
                raise
            return None
        finally:
            await probe.aclose()
        return bool(int(info.get("cluster_enabled", 0)))
