"""The valkey tier's backend: pipelined batches against one Valkey/Redis server or cluster.

Every primitive runs on the tier's event loop (:class:`kvplug.RecordTier`) and sends
one pipeline: N keys cost one round trip (in cluster mode, one per node holding
some of them; valkey-py groups the commands by slot owner). The client is made on
first use, on that loop, with one connection pool; when ``cluster`` is unset the
first call asks the server (``INFO cluster``) which client it needs. ``cluster: false``
on a cluster node is refused (:class:`~kvplug_valkey.clients.WrongModeError`) at the
first ``MOVED`` and before the first listing, and ``cluster: true`` on a standalone
server is permanent in :func:`~kvplug_valkey.failures.classify`.

Per-key answers that are not failures of the server come back as values: a key
of another type (``WRONGTYPE``) reads as a foreign record (too short: corrupt, so the
tier deletes it), a store refused for memory (``OOM``) as a dropped write, counted
here (``oom_dropped_puts``). Anything else (connection refused or reset, timeout,
authentication, cluster down) raises, and the tier's retry policy and circuit
breaker judge it. In a cluster, a node that fails costs the keys on it alone
(:mod:`kvplug_valkey.nodes`: a breaker per node): its keys' slots hold a
:class:`~kvplug_valkey.nodes.NodeDownError`, no answer for them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from valkey import exceptions as vex

from kvplug import Buffer, CallSizes, FailureKind, RecordBackend, RecordToWrite, StoredRecord, WriteRefusals
from kvplug.errors import CorruptChunkError
from kvplug_valkey import delete_script
from kvplug_valkey.clients import Client, ValkeyClients, WrongModeError
from kvplug_valkey.config import ValkeyTierConfig
from kvplug_valkey.failures import classify, per_key, raise_server_errors, unanswered
from kvplug_valkey.nodes import ClusterNodes, NodeDownError
from kvplug_valkey.plain_server import raise_if_plain
from kvplug_valkey.write_refusals import refused_write, write_probe

#: SCAN page size: keys per round trip when listing.
SCAN_COUNT = 1000
#: Keys per pipeline for commands with small replies (STRLEN, EXISTS, DEL): a lookup is one round trip.
SMALL_REPLY_KEYS = 1024
#: A value that is not a string (another program's key under our prefix).
FOREIGN = b""


class ValkeyBackend(RecordBackend):
    """Batched GET (or GETRANGE)/SET/STRLEN/EXISTS/DEL/SCAN under ``key_prefix``; see the module docstring."""

    #: The server's ``maxmemory`` policy and TTLs remove keys without telling any client.
    evicts_on_its_own = True

    def __init__(
        self,
        config: ValkeyTierConfig,
        record_bound: Callable[[], int | None] = lambda: None,
        on_node_failure: Callable[[BaseException], None] = lambda exc: None,
        on_node_short_circuit: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        #: Where a cluster node's failures and short-circuited calls are counted (the tier's metrics).
        self._on_node_failure = on_node_failure
        self._on_node_short_circuit = on_node_short_circuit
        #: The server said it is no cluster node (see :meth:`_check_standalone`).
        self._standalone_checked = False
        #: SETs the ACL refuses, while reads go on (a read-only user).
        self.refusals = WriteRefusals(config.breaker_cooldown_s)
        #: The ACL refused a key: each key is asked about before its value is sent
        #: (:func:`~kvplug_valkey.write_refusals.write_probe`).
        self.probe_keys = False
        #: The server refused the compare-and-delete script (see :meth:`delete_if_same`).
        self.scripts_refused = False
        #: The tier's ``max_record_bytes``, read at each read (the engine may raise it).
        self._record_bound = record_bound
        self.address = config.address
        self.where = self.address.display()
        self.call_sizes = CallSizes(
            query=SMALL_REPLY_KEYS,
            read=config.pipeline_keys,
            write=config.pipeline_keys,
            write_bytes=int(config.pipeline_bytes),
        )
        self.prefix = config.key_prefix.encode()
        self.cluster: bool | None = config.cluster
        #: Stores the server refused for memory (``maxmemory`` with ``noeviction``).
        self.oom_dropped = 0
        self._client: Client | None = None
        self._nodes: ClusterNodes | None = None
        self._lock: asyncio.Lock | None = None
        self._clients = ValkeyClients(config, record_bound)
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))

    def key(self, name: str) -> bytes:
        """The server key of a record: ``key_prefix`` and the digest."""
        return self.prefix + name.encode()

    def classify(self, exc: BaseException) -> FailureKind:
        return classify(exc)

    def describe(self) -> dict[str, int | float | str]:
        described: dict[str, int | float | str] = {
            "url": self.where,
            "cluster": "unknown" if self.cluster is None else str(self.cluster).lower(),
            "oom_dropped_puts": self.oom_dropped,
        }
        if self._nodes is not None:
            described.update(self._nodes.describe())
        return described

    def errors(self) -> int:
        return 0 if self._nodes is None else self._nodes.failures

    # --- batches --------------------------------------------------------------------

    async def sizes(self, names: Sequence[str]) -> list[int | None | BaseException]:
        """STRLEN per key: 0 is a key evicted, expired or deleted (``None``); a key of
        another type answers 0 bytes (there, but no record)."""
        results = await self._pipeline([("STRLEN", self.key(n)) for n in names])
        return [unanswered(r, 0) if isinstance(r, BaseException) else (int(r) or None) for r in results]

    async def exists(self, names: Sequence[str]) -> list[bool | BaseException]:
        """Whether each key exists (of any type), without touching it.

        ``EXISTS`` leaves a key's LRU/LFU data as it was (every Valkey; Redis before
        6.0 and since 6.2: early 6.0 releases touched, redis/redis#8016, no worse than
        ``STRLEN``), where a read such as ``STRLEN`` makes it look freshly used to the
        server: the index's round of checks must not keep this process's cold keys
        alive in a server that other clients share. (``CLIENT NO-TOUCH`` would need
        Valkey/Redis 7.2 and an error path on older servers.)"""
        results = await self._pipeline([("EXISTS", self.key(n)) for n in names])
        return [unanswered(r, True) if isinstance(r, BaseException) else int(r) > 0 for r in results]

    async def read(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | BaseException | None]:
        """Each stored value (``FOREIGN`` for a non-string key), ``None`` where missing.

        With a bound on records (the tier's ``max_record_bytes``), ``GETRANGE`` asks for
        one byte more than it: a longer value is corrupt, and the server sends no more of
        it (a writer of the server could otherwise make a reader take 512 MiB a key).
        ``GETRANGE`` answers a missing key with no bytes, as ``STRLEN`` does: not there."""
        return await self._read(names, touch=True)

    async def peek(self, names: Sequence[str], sizes: Sequence[int | None]) -> list[Buffer | BaseException | None]:
        """:meth:`read` for inspection (``kvplug store verify``, ``kvplug explain``), which
        leaves the keys' LRU/LFU data as it was on a standalone server: a ``GET`` makes a key
        look freshly used, so verifying a shared server would reorder its whole eviction.
        ``CLIENT NO-TOUCH`` (Valkey/Redis 7.2+) brackets the reads in the same pipeline, on
        one connection; an older server refuses it and the reads touch as before. In a
        cluster the reads touch (each node's connection would need the flag)."""
        await self.client()  # (which sets ``cluster`` when the config leaves it to the server)
        return await self._read(names, touch=bool(self.cluster))

    async def _read(self, names: Sequence[str], *, touch: bool) -> list[Buffer | BaseException | None]:
        bound = self._record_bound()
        reads: list[tuple[Any, ...]] = (
            [("GET", self.key(n)) for n in names]
            if bound is None
            else [("GETRANGE", self.key(n), 0, bound) for n in names]
        )
        if touch:
            results = await self._pipeline(reads)
        else:
            # A connection that fails or is cancelled mid-pipeline is closed by the client,
            # so none goes back to the pool with the flag still on.
            on, off = ("CLIENT", "NO-TOUCH", "ON"), ("CLIENT", "NO-TOUCH", "OFF")
            results = (await self._pipeline([on, *reads, off], per_key=lambda _: True))[1:-1]
            # The flag's own answers are not checked: a server before 7.2, or one that
            # refuses CLIENT to this user, reads as before (touching).
            raise_server_errors(results, per_key)
        if bound is None:
            return [unanswered(r, FOREIGN) if isinstance(r, BaseException) else r for r in results]
        values: list[Buffer | BaseException | None] = []
        for result in results:
            if isinstance(result, BaseException):
                values.append(unanswered(result, FOREIGN))
            elif len(result) > bound:
                values.append(CorruptChunkError(f"record is over the {bound} bytes a record of this store can be"))
            else:
                values.append(result or None)
        return values

    async def write(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        """SET each record (one buffer per SET: the value copied once, behind its header);
        an OOM refusal drops that record alone, counted. Once the ACL refused a key, the
        keys it refuses are told without their values (:meth:`_keys_refused`)."""
        expiry: tuple[Any, ...] = () if self._ttl_ms is None else ("PX", self._ttl_ms)
        refused = self.refusals.current()
        if refused is not None:
            return [refused] * len(records)
        await self.client()  # (its INFO refused is no refusal of writes)
        outcomes: list[BaseException | None] = [None] * len(records)
        if self.probe_keys:
            outcomes = await self._keys_refused(records)
        sending = [i for i, outcome in enumerate(outcomes) if outcome is None]
        sets = [("SET", self.key(records[i].name), records[i].joined(), *expiry) for i in sending]
        # NOPERM is each SET's own answer (a cluster node that gives it still answers: its
        # breaker stays closed, its keys keep hitting); see kvplug_valkey.write_refusals.
        results = await self._pipeline(sets, per_key=lambda r: per_key(r) or refused_write(r) is not None)
        for i, result in zip(sending, results):
            outcomes[i] = self._set_outcome(result)
        if any(outcomes[i] is None for i in sending):
            self.refusals.accepted()
        return outcomes

    def _set_outcome(self, result: Any) -> BaseException | None:
        refusal = refused_write(result)
        if refusal == "user":  # an ACL that allows reads: they go on (see WriteRefusals)
            return self.refusals.refused(self.where, f"NOPERM: {result}")
        if refusal == "key":
            self.probe_keys = True
            return PermissionError(f"{self.where} refuses this key to the user (NOPERM: {result})")
        if isinstance(result, NodeDownError):  # a cluster node that does not answer
            return result
        if isinstance(result, BaseException):  # the other per-key errors that reach here: OOM
            self.oom_dropped += 1
            return MemoryError("the server is out of memory (maxmemory, noeviction)")
        return None

    async def _keys_refused(self, records: Sequence[RecordToWrite]) -> list[BaseException | None]:
        """The ACL's refusal of each record's key, asked without its value; ``None``: send it."""
        probes = [write_probe(self.key(r.name)) for r in records]
        results = await self._pipeline(probes, per_key=lambda r: per_key(r) or refused_write(r) is not None)
        if any(refused_write(r) == "user" for r in results):
            # The user may not run the probe itself (SET but no SETRANGE): values are sent.
            self.probe_keys = False
            return [None] * len(records)
        return [
            PermissionError(f"{self.where} refuses this key to the user (NOPERM: {r})")
            if refused_write(r) == "key"
            else None
            for r in results
        ]

    async def delete(self, names: Sequence[str]) -> list[bool | BaseException]:
        results = await self._pipeline([("DEL", self.key(n)) for n in names])
        return [unanswered(r, False) if isinstance(r, BaseException) else int(r) > 0 for r in results]

    async def delete_if_same(self, names: Sequence[str], seen: Sequence[Buffer | None]) -> list[bool | BaseException]:
        """One script per key, run atomically by the server: DEL only if the key still holds
        the bytes read (their SHA-1, so the record is not sent back), is still not a string
        (``FOREIGN``), or (``None``: read as over the record bound) is still longer than it."""
        bound = self._record_bound()
        commands = [delete_script.delete_if_same(self.key(n), data, bound) for n, data in zip(names, seen)]
        results = await self._pipeline(commands, per_key=lambda r: per_key(r) or delete_script.script_refused(r))
        if any(isinstance(r, BaseException) and delete_script.script_refused(r) for r in results):
            # From now on corrupt records are kept (absent to the tier), and the removal of an
            # unusable chunk re-reads it, then removes by name.
            self.scripts_refused = True
        return [r if isinstance(r, BaseException) else int(r) > 0 for r in results]

    @property
    def deletes_if_same(self) -> bool:
        return not self.scripts_refused

    async def listing(self) -> list[StoredRecord]:
        """Every key under the prefix named by a digest (SCAN; every primary of a cluster), with its size."""
        client = await self.client()
        match = self.prefix + b"*"
        if self._nodes is not None:
            listed = await self._nodes.keys(match, SCAN_COUNT)
        else:
            await self._check_standalone()
            listed = [key async for key in client.scan_iter(match=match, count=SCAN_COUNT)]
        keys: list[bytes] = []
        for key in listed:
            digest = key[len(self.prefix) :]
            if len(digest) == 64 and all(c in b"0123456789abcdef" for c in digest):
                keys.append(key)
        found: list[StoredRecord] = []
        for start in range(0, len(keys), SCAN_COUNT):
            page = keys[start : start + SCAN_COUNT]
            sizes = await self._pipeline([("STRLEN", key) for key in page])
            for key, size in zip(page, sizes):
                if not isinstance(size, BaseException) and int(size) > 0:
                    found.append(StoredRecord(key[len(self.prefix) :].decode(), int(size), None))
        return found

    async def _check_standalone(self) -> None:
        """Before the first SCAN of ``cluster: false``: a cluster node's SCAN lists its own keys
        alone, which every command that lists would take for all (no ``MOVED`` says otherwise)."""
        if self._standalone_checked:
            return
        if await self._clients.cluster_enabled(trust_config=True):
            raise WrongModeError.not_standalone(self.where, "INFO cluster")
        self._standalone_checked = True

    # --- client ---------------------------------------------------------------------

    async def client(self) -> Client:
        """The client, made on first use (asking the server whether it is a cluster when unset)."""
        if self._client is not None:
            return self._client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._client is not None:
                return self._client
            if self.cluster is None:
                try:
                    self.cluster = bool(await self._clients.cluster_enabled(trust_config=False))
                except vex.NoPermissionError as exc:  # (said as valkey's bare NOPERM, naming no option)
                    raise WrongModeError.cannot_ask(self.where, exc) from None
                except (vex.TimeoutError, vex.ConnectionError) as exc:
                    await self._tls_hint(exc)
                    raise
            self._client = self._clients.cluster() if self.cluster else self._clients.standalone()
            if self.cluster:
                self._nodes = ClusterNodes(
                    self._client,
                    self._clients.node,
                    breaker_failures=self.config.breaker_failures,
                    breaker_cooldown_s=self.config.breaker_cooldown_s,
                    request_timeout_s=self.config.request_timeout_s,
                    retries=self.config.retries,
                    tls=self.config.address.tls,
                    on_failure=self._on_node_failure,
                    on_short_circuit=self._on_node_short_circuit,
                )
            return self._client

    async def _pipeline(
        self, commands: Sequence[tuple[Any, ...]], per_key: Callable[[BaseException], bool] = per_key
    ) -> list[Any]:
        if not commands:
            return []
        client = await self.client()
        if self._nodes is not None:
            try:
                return await self._nodes.pipeline(commands, lambda results: raise_server_errors(results, per_key))
            except NodeDownError as exc:  # (raised, not an answer: no node gave the map of slots)
                if isinstance(exc.__cause__, (vex.TimeoutError, vex.ConnectionError)):
                    await self._tls_hint(exc)
                raise
        pipe = client.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        try:
            results = await pipe.execute(raise_on_error=False)
        except (vex.TimeoutError, vex.ConnectionError) as exc:
            await self._tls_hint(exc)
            raise
        try:
            raise_server_errors(results, per_key)
        except vex.ResponseError as exc:
            if str(exc).upper().startswith(("MOVED ", "ASK ")):
                raise WrongModeError.not_standalone(self.where, str(exc)) from exc
            raise
        return list(results)

    async def _tls_hint(self, failure: BaseException) -> None:
        """A TLS url whose server answers without TLS fails every connection as a timeout
        (or a handshake error): say so, permanently (:mod:`kvplug_valkey.plain_server`)."""
        if self.address.tls:
            await raise_if_plain(
                self.where, self.address.host, self.address.port, self.config.connect_timeout_s, failure
            )

    async def close(self) -> None:
        nodes, self._nodes = self._nodes, None
        if nodes is not None:
            await nodes.close()
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()
