"""Tier ``valkey``: a Valkey or Redis server (or cluster) shared by many engines.

Each value is stored under ``key_prefix + sha256(key)`` as the same key-bound,
checksummed record as the disk and s3 tiers; :class:`kvplug.RecordTier` frames,
verifies (a torn, swapped or damaged value is a miss, counted, and deleted), indexes
and budgets them, under deadlines, bounded retries and a circuit breaker: a server
that is down, hung or refusing costs one failed batch, then lookups miss and stores
are dropped at no cost until it answers again. This module parses locations; the
backend (:mod:`kvplug_valkey.backend`) speaks the server in pipelines. The server's
``maxmemory`` and LRU policy are the shared budget; an OOM refusal is a dropped
store, counted. ``stats()`` items and bytes come from this process's bounded index of
its keys (:class:`kvplug.core.records.index.RecordIndex`): an estimate, since the server evicts without
telling its clients. The index's round of ``EXISTS`` checks finds evicted keys while
they are at most about a quarter of it: with this process the only writer of chunks of
one size (a model's chunks are), items and bytes are at most about a third above what
the server holds; with other writers filling the server, keys may stay indexed after
they are gone until the round reaches them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit, urlunsplit

from kvplug import RecordBackend, RecordTier
from kvplug_valkey.config import SCHEMES, ValkeyTierConfig


class ValkeyTier(RecordTier):
    """A Valkey/Redis server or cluster as a storage tier; see the module docstring."""

    name = "valkey"
    medium = "remote"
    Config = ValkeyTierConfig
    config: ValkeyTierConfig

    def open_backend(self, loop: asyncio.AbstractEventLoop) -> RecordBackend:
        # The client library loads with the first tier opened: listing plugins, checking a
        # config or opening another store does not import it.
        from kvplug_valkey.backend import ValkeyBackend

        ca_file = self.config.tls_ca_file
        if ca_file is not None:
            # Checked here, where the tier runs: the client would read it at each connection
            # and say only "Error 2 connecting to host:port. No such file or directory".
            try:
                with open(ca_file, "rb"):
                    pass
            except OSError as exc:
                raise ValueError(f"tls_ca_file {ca_file} cannot be read: {exc.strerror or exc}") from None
        # A cluster node's failures count in the tier's remote metrics, under the label the
        # tier's own calls use (kvplug.RemoteCalls: "<tier index>:<name>"), kind "node_<type>".
        metrics, label = self.context.metrics, f"{self.context.tier_index}:{self.name}"

        def node_failed(exc: BaseException) -> None:
            kind = "timeout" if isinstance(exc, TimeoutError) else type(exc).__name__
            metrics.remote_failures.labels(label, f"node_{kind}").inc()

        def node_short_circuited() -> None:
            metrics.remote_short_circuits.labels(label).inc()

        return ValkeyBackend(
            self.config,
            record_bound=lambda: self.context.max_record_bytes,
            on_node_failure=node_failed,
            on_node_short_circuit=node_short_circuited,
        )

    @classmethod
    def location_config(cls, location: str, options: Mapping[str, Any]) -> ValkeyTierConfig | None:
        """``redis://``, ``rediss://``, ``valkey://``, ``valkeys://`` and ``unix://`` URLs open as this tier.

        ``?prefix=P`` in the location selects the key prefix (default ``kvplug:``); the
        password comes from ``REDISCLI_AUTH`` (as for valkey-cli and redis-cli; never the
        command line, where ``ps`` shows it). ``options`` may set ``password``,
        ``username``, ``key_prefix`` and ``cluster``."""
        if "://" not in location or location.split("://", 1)[0].lower() not in SCHEMES:
            return None
        allowed = {"password", "username", "key_prefix", "cluster"}
        given = {name: value for name, value in options.items() if value is not None}
        unknown = sorted(set(given) - allowed)
        if unknown:
            raise ValueError(
                f"option(s) {', '.join(unknown)} do not apply to a valkey store; it takes {sorted(allowed)}"
            )
        parts = urlsplit(location)
        query = parse_qs(parts.query, keep_blank_values=True)
        if "prefix" in query:
            given.setdefault("key_prefix", query.pop("prefix")[-1])
            location = urlunsplit(parts._replace(query=urlencode(query, doseq=True)))
        if "password" not in given and os.environ.get("REDISCLI_AUTH"):
            given["password"] = os.environ["REDISCLI_AUTH"]
        # Inspection must survive slow listings of a big prefix; nothing is ever evicted (no max_bytes).
        return ValkeyTierConfig(url=location, request_timeout_s=30.0, **given)
