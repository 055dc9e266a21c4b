"""How the scheduler-side connector asks the worker's cache engine what it holds.

The worker owns the :class:`kvplug.CacheEngine` and its tiers. With vLLM's
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler finds that
engine in :data:`_LOCAL_WORKERS` and calls it directly. With the multiprocess
engine the scheduler (EngineCore process) and the worker are different
processes: the scheduler then asks the worker's control socket
(:class:`kvplug.ControlServer`, the one ``kvplug ctl`` talks to), whose ``lookup``
op answers with typed locations and whose ``reset`` op runs the worker's cache reset.
One socket per worker, one codec (:mod:`kvplug.core.control.protocol`: no pickle,
sizes bounded before anything is allocated), one private folder (links,
foreign-owned or open folders refused, peers of another user closed).

Answers are :class:`kvplug.ChunkLocation` lists: the adapter tells tiers apart by
their medium, never by their names.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplug import (
    CacheEngine,
    ChunkLocation,
    KVPlugConfig,
    RequestInfo,
    check_socket_file,
    control_request_fields,
    control_socket_path,
    encode_control_request,
    exchange_control_request,
    get_registry,
    hit_tokens,
    merge_locations,
)
from kvplug.errors import ControlError, ControlProtocolError, KVPlugError, UnsafeSocketPathError

logger = logging.getLogger("kvplug.vllm.lookup")

#: Cuts a lookup's answer short, e.g. to a chunk end with a recurrent state
#: (:class:`kvplug_vllm.state_groups.StateBoundaries`): (tokens, request, answer).
TrimHit = Callable[[Sequence[int], RequestInfo | None, list[ChunkLocation]], list[ChunkLocation]]


@dataclass(frozen=True)
class LocalWorker:
    """A worker in this process (vLLM's in-process engine), as the scheduler side finds it."""

    engine: CacheEngine
    #: Removes the worker's chunks from the tiers vLLM's prefix cache reset empties; returns how many.
    reset: Callable[[], int]
    #: Applied to every answer of ``engine`` (a model with recurrent-state groups), or None.
    trim: TrimHit | None = None


#: (engine id, data-parallel rank, worker) -> the worker in this process. A worker is its tensor-parallel
#: rank among the engine's ``tp_size * pp_size`` (``pp_rank * tp_size + tp_rank``, kvplug's
#: ``ControlIdentity.worker``): each pipeline stage holds other layers, in a cache engine of its own.
_LOCAL_WORKERS: dict[tuple[str, int, int], LocalWorker] = {}
_LOCAL_LOCK = threading.Lock()


class LookupChannelError(KVPlugError):
    """A lookup could not be answered (the worker is gone, slow or said no)."""


def register_local(engine_key: tuple[str, int, int], worker: LocalWorker) -> None:
    with _LOCAL_LOCK:
        _LOCAL_WORKERS[engine_key] = worker


def unregister_local(engine_key: tuple[str, int, int]) -> None:
    with _LOCAL_LOCK:
        _LOCAL_WORKERS.pop(engine_key, None)


def local_worker(engine_key: tuple[str, int, int]) -> LocalWorker | None:
    with _LOCAL_LOCK:
        return _LOCAL_WORKERS.get(engine_key)


def socket_path(engine_id: str, dp_rank: int, worker: int) -> Path:
    """The socket one worker answers its scheduler on: its control socket."""
    try:
        return control_socket_path(engine_id, dp_rank, worker)
    except UnsafeSocketPathError as exc:
        raise LookupChannelError(str(exc)) from None


class SocketLookup:
    """Asks every worker of one engine (each tensor-parallel rank of each pipeline stage) over
    its control socket, all at once; the hit is the prefix all hold (:func:`kvplug.merge_locations`)."""

    def __init__(self, paths: Sequence[Path], timeout_s: float) -> None:
        self.paths = list(paths)
        self.timeout_s = timeout_s
        self._socks: dict[Path, socket.socket] = {}
        self._lock = threading.Lock()
        self._closed = False
        # One after another, a lookup took the sum of the workers' answers (up to
        # lookup_timeout_s each): at once, the slowest one's.
        self._asking = ThreadPoolExecutor(len(self.paths), "kvplug-lookup") if len(self.paths) > 1 else None

    def _ask_all(self, message: bytes) -> list[dict[str, Any]]:
        """Every worker's reply to ``message``, asked in parallel (holds ``_lock``)."""
        if self._closed:  # a background lookup that waited for the lock: no new connection, no thread
            raise LookupChannelError("the lookup channel is closed")
        if self._asking is None:
            return [self._exchange(path, message) for path in self.paths]
        asked = [self._asking.submit(self._exchange, path, message) for path in self.paths]
        # Every exchange ends (answered, failed or timed out) before the lock is let go: a
        # socket still waiting for its reply must not carry the next request.
        wait(asked)
        return [future.result() for future in asked]

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> int:
        return hit_tokens(self.locate(tokens, request))

    def locate(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation]:
        """Per chunk of the prefix every worker holds: where it is (the slowest worker's medium)."""
        try:
            message = encode_control_request("lookup", control_request_fields(request), tokens)
        except ControlProtocolError as exc:
            raise LookupChannelError(f"lookup not sent: {exc}") from None
        with self._lock:
            answers = self._ask_all(message)
        try:
            return merge_locations([[ChunkLocation.from_json(raw) for raw in a["locations"]] for a in answers])
        except (KeyError, TypeError, ValueError) as exc:
            raise LookupChannelError(f"a worker's lookup answer is not understood: {exc!r}") from None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()
        if self._asking is not None:
            self._asking.shutdown(wait=False)

    def inline_lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation] | None:
        """``None``: a worker's answer may need a slow tier, so the scheduler never asks it
        from its own thread in background mode."""
        return None

    def reset(self) -> int:
        """Ask every worker to run its ``reset_cache``; returns the chunks removed."""
        message = encode_control_request("reset")
        with self._lock:
            return sum(int(answer.get("removed", 0)) for answer in self._ask_all(message))

    def _exchange(self, path: Path, message: bytes) -> dict[str, Any]:
        for attempt in (1, 2):  # one reconnect: the worker may have restarted its server
            sock = self._socks.get(path)
            try:
                if sock is None:
                    check_socket_file(path)
                    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    sock.settimeout(self.timeout_s)
                    sock.connect(str(path))
                    self._socks[path] = sock
                reply = exchange_control_request(sock, message)
            except UnsafeSocketPathError as exc:
                raise LookupChannelError(str(exc)) from None
            except (OSError, ControlError) as exc:
                self._socks.pop(path, None)
                if sock is not None:
                    sock.close()
                # A worker that says nothing for the whole timeout is not asked again: the
                # scheduler may be waiting on its own thread, and lookup_timeout_s is the bound.
                hung = isinstance(exc, TimeoutError) or isinstance(exc.__cause__, TimeoutError)
                if hung:
                    raise LookupChannelError(
                        f"lookup via {path} failed: no answer within lookup_timeout_s ({self.timeout_s} s)"
                    ) from exc
                if attempt == 2:
                    raise LookupChannelError(f"lookup via {path} failed: {exc}") from exc
                continue
            if "error" in reply:
                raise LookupChannelError(f"worker could not look up: {reply['error']}")
            return reply
        raise AssertionError("unreachable")


class DirectLookup:
    """The worker's engines live in this process: call them."""

    def __init__(
        self,
        engines: Sequence[CacheEngine],
        resets: Sequence[Callable[[], int]],
        trims: Sequence[TrimHit | None] = (),
    ) -> None:
        self.engines = list(engines)
        #: Per engine, what cuts its answers short (None: nothing).
        self.trims = list(trims) or [None] * len(self.engines)
        self.resets = list(resets)

    def reset(self) -> int:
        return sum(reset() for reset in self.resets)

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> int:
        return hit_tokens(self.locate(tokens, request))

    def locate(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation]:
        answers = [engine.locate(tokens, request=request) for engine in self.engines]
        return merge_locations(self._trimmed(tokens, request, answers))

    def _trimmed(
        self, tokens: Sequence[int], request: RequestInfo, answers: list[list[ChunkLocation]]
    ) -> list[list[ChunkLocation]]:
        return [a if trim is None else trim(tokens, request, a) for trim, a in zip(self.trims, answers)]

    def inline_lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[ChunkLocation] | None:
        """The answer of :meth:`locate` when the tiers that answer inline give it alone
        (:meth:`kvplug.CacheEngine.locate_inline`); ``None`` when a slower tier could add to it."""
        answers = []
        for engine in self.engines:
            found = engine.locate_inline(tokens, request=request, count=False)
            if found is None:
                return None
            answers.append(found)
        for engine, found in zip(self.engines, answers):  # counted once every engine answered
            engine.count_lookup(len(tokens), hit_tokens(found))
        return merge_locations(self._trimmed(tokens, request, answers))

    def close(self) -> None:
        pass


def open_channel(
    engine_key: tuple[str, int, int], num_workers: int, mode: str, timeout_s: float
) -> DirectLookup | SocketLookup:
    """The scheduler's way to every worker of its engine (``num_workers``: every tensor-parallel rank
    of every pipeline stage; a chunk is a hit only if all hold it), by ``lookup_channel``:
    direct when their engines are in this process (``auto``), else over their sockets."""
    engine_id, dp_rank, _ = engine_key
    keys = [(engine_id, dp_rank, worker) for worker in range(num_workers)]
    workers = [w for w in (local_worker(key) for key in keys) if w is not None]
    channel: DirectLookup | SocketLookup
    if mode == "direct" or (mode == "auto" and len(workers) == len(keys)):
        if len(workers) < len(keys):
            raise LookupChannelError("lookup_channel: direct, but the worker's cache engine is not in this process")
        channel = DirectLookup([w.engine for w in workers], [w.reset for w in workers], trims=[w.trim for w in workers])
    else:
        channel = SocketLookup([socket_path(*key) for key in keys], timeout_s)
    where = (
        "directly to the worker's engine" if isinstance(channel, DirectLookup) else "over the worker's lookup socket"
    )
    logger.info("kvplug lookups go %s", where)
    return channel


def inline_tiers(config: KVPlugConfig) -> frozenset[str]:
    """The tier types in ``config`` that answer lookups inline (:attr:`kvplug.StorageTier.inline_lookups`,
    or medium ``memory``): the scheduler asks them on its own thread, the others in the background."""
    classes = (config.registry or get_registry()).storage_tiers()
    return frozenset(
        spec.type
        for spec in config.tiers
        if spec.type in classes and (classes[spec.type].medium == "memory" or classes[spec.type].inline_lookups)
    )
