"""How the scheduler-side connector asks the worker's cache engine what it holds.

The worker owns the :class:`kvplug.CacheEngine` and its tiers. With vLLM's
in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) the scheduler finds that
engine in :data:`_LOCAL_WORKERS` and calls it directly. With the multiprocess
engine the scheduler (EngineCore process) and the worker are different
processes: the worker then serves lookups on a unix socket and the scheduler
connects to it (LMCache does the same over ZMQ).

Wire format, no pickle: each message is ``<u32 length>`` + body. A request body
is ``<u32 header length>`` + a JSON header + the token ids as little-endian
int64; a reply body is JSON, ``{"hit": n, "tiers": [[tier, tokens], ...]}`` or ``{"error": "..."}``. The socket
lives in this user's private folder (see :mod:`kvplug_vllm.socket_server`: links,
foreign-owned or open folders are refused), named from a sha256 of the engine id
and ranks, never from user text. Sizes and counts of a request are bounded before
anything is allocated for them (:data:`MAX_TOKENS`, :data:`MAX_HEADER_BYTES`,
:data:`MAX_EXTRA_KEYS`), and the server holds any client to deadlines and byte limits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import socket
import struct
import threading
from array import array
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplug import MEDIA, CacheEngine, ExtraKey, KVPlugConfig, Medium, RequestInfo, get_registry
from kvplug.errors import KVPlugError
from kvplug_vllm.socket_server import (
    MessageServer,
    ServerLimits,
    UnsafeSocketPathError,
    check_socket_file,
    private_socket_dir,
)

logger = logging.getLogger("kvplug.vllm.lookup")

#: Cuts a lookup's answer (per chunk: tier, tokens) short, e.g. to a chunk end with a
#: recurrent state (:class:`kvplug_vllm.state_groups.StateBoundaries`): (tokens, request, answer).
TrimHit = Callable[[Sequence[int], RequestInfo | None, list[tuple[str, int]]], list[tuple[str, int]]]

_LEN = struct.Struct("<I")
#: Most prompt tokens one lookup may carry (a 16 MiB message).
MAX_TOKENS = 2 * 1024 * 1024
#: Largest JSON header of a request (salt, LoRA, extra keys, overrides).
MAX_HEADER_BYTES = 256 * 1024
#: Most extra keys (multimodal hashes, LoRA ranges) of one request.
MAX_EXTRA_KEYS = 4096
MAX_OVERRIDES = 64
MAX_TEXT = 1024
#: Largest message either side accepts.
_MAX_MESSAGE = _LEN.size + MAX_HEADER_BYTES + 8 * MAX_TOKENS
LOOKUP_LIMITS = ServerLimits(max_message_bytes=_MAX_MESSAGE, max_buffered_bytes=4 * _MAX_MESSAGE)


@dataclass(frozen=True)
class LocalWorker:
    """A worker in this process (vLLM's in-process engine), as the scheduler side finds it."""

    engine: CacheEngine
    #: Removes the worker's chunks from the tiers vLLM's prefix cache reset empties; returns how many.
    reset: Callable[[], int]
    #: Applied to every answer of ``engine`` (a model with recurrent-state groups), or None.
    trim: TrimHit | None = None


#: (engine id, data-parallel rank, tensor-parallel rank) -> the worker in this process.
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


def socket_path(engine_id: str, dp_rank: int, tp_rank: int) -> Path:
    """The lookup socket of one worker; this user's private folder, a hex name."""
    try:
        folder = private_socket_dir()
    except UnsafeSocketPathError as exc:
        raise LookupChannelError(str(exc)) from None
    name = hashlib.sha256(f"{engine_id}\0{dp_rank}\0{tp_rank}".encode()).hexdigest()[:32]
    return folder / f"lookup-{name}.sock"


# --- encoding ---------------------------------------------------------------------------


def encode_request(tokens: Sequence[int], request: RequestInfo) -> bytes:
    header = json.dumps(
        {
            "op": "lookup",
            "cache_salt": request.cache_salt,
            "lora_id": request.lora_id,
            "extra_keys": [[k.start, k.end, k.value] for k in request.extra_keys],
            "overrides": dict(request.overrides),
        }
    ).encode()
    packed = array("q", tokens)
    if struct.pack("=q", 1) != struct.pack("<q", 1):  # pragma: no cover - big-endian hosts
        packed.byteswap()
    return _LEN.pack(len(header)) + header + packed.tobytes()


def encode_reset() -> bytes:
    """A ``reset`` message: header only, no tokens."""
    header = json.dumps({"op": "reset"}).encode()
    return _LEN.pack(len(header)) + header


def _header_of(body: bytes) -> tuple[dict[str, Any], int]:
    """The JSON header of a message and where the tokens start; sizes checked before parsing."""
    if len(body) < _LEN.size:
        raise ValueError("message shorter than its header length")
    (header_len,) = _LEN.unpack_from(body)
    if header_len > MAX_HEADER_BYTES or header_len > len(body) - _LEN.size:
        raise ValueError(f"header of {header_len} bytes: over {MAX_HEADER_BYTES} or longer than the message")
    header = json.loads(body[_LEN.size : _LEN.size + header_len])
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, _LEN.size + header_len


def is_reset(body: bytes) -> bool:
    return _header_of(body)[0].get("op") == "reset"


def _text(value: Any, name: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_TEXT:
        raise ValueError(f"{name} must be a string of at most {MAX_TEXT} characters")
    return value


def _extra_keys(raw: Any) -> tuple[ExtraKey, ...]:
    if not isinstance(raw, list) or len(raw) > MAX_EXTRA_KEYS:
        raise ValueError(f"extra_keys must be a list of at most {MAX_EXTRA_KEYS} [start, end, value] entries")
    keys = []
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 3 and all(type(x) is int for x in entry[:2])):
            raise ValueError("an extra key is [start, end, value] with integer start and end")
        keys.append(ExtraKey(entry[0], entry[1], _text(entry[2], "an extra key value") or ""))
    return tuple(keys)


def decode_request(body: bytes) -> tuple[list[int], RequestInfo]:
    header, tokens_at = _header_of(body)
    if header.get("op") != "lookup":
        raise ValueError(f"unknown op {str(header.get('op'))[:40]!r}")
    raw = memoryview(body)[tokens_at:]
    if len(raw) % 8 or len(raw) // 8 > MAX_TOKENS:
        raise ValueError(f"tokens must be whole int64s, at most {MAX_TOKENS} of them")
    overrides = header.get("overrides") or {}
    if not isinstance(overrides, dict) or len(overrides) > MAX_OVERRIDES:
        raise ValueError(f"overrides must be a mapping of at most {MAX_OVERRIDES} settings")
    tokens = array("q")
    tokens.frombytes(raw)
    if struct.pack("=q", 1) != struct.pack("<q", 1):  # pragma: no cover
        tokens.byteswap()
    info = RequestInfo(
        cache_salt=_text(header.get("cache_salt"), "cache_salt"),
        lora_id=_text(header.get("lora_id"), "lora_id"),
        extra_keys=_extra_keys(header.get("extra_keys", [])),
        overrides=dict(overrides),
    )
    return tokens.tolist(), info


# --- server (worker side) -----------------------------------------------------------------


class LookupServer(MessageServer):
    """Answers lookups for one worker's engine on a unix socket, from one thread.

    The socket handling (limits, deadlines, private folder) is :class:`MessageServer`'s.
    """

    thread_name = "kvplug-lookup-server"

    def __init__(
        self,
        engine: CacheEngine,
        path: Path,
        on_reset: Callable[[], int] | None = None,
        limits: ServerLimits = LOOKUP_LIMITS,
        trim: TrimHit | None = None,
    ) -> None:
        self.engine = engine
        self.trim = trim
        #: What a ``reset`` message runs (the worker's ``reset_cache``): returns chunks removed.
        self.on_reset = on_reset
        super().__init__(path, limits)

    def answer(self, body: bytes) -> bytes:
        return self._answer(body)

    def _answer(self, body: bytes) -> bytes:
        try:
            if self.on_reset is not None and is_reset(body):
                return json.dumps({"removed": self.on_reset()}).encode()
            tokens, info = decode_request(body)
            tiers = self.engine.lookup_tiers(tokens, request=info)
            if self.trim is not None:
                tiers = self.trim(tokens, info, tiers)
            return json.dumps({"hit": sum(n for _, n in tiers), "tiers": tiers}).encode()
        except Exception as exc:  # a bad request or a closed engine: the client sees a miss
            logger.warning("lookup request failed: %s", exc)
            return json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()


# --- client (scheduler side) ---------------------------------------------------------------


class SocketLookup:
    """Asks every tensor-parallel worker of one engine; the hit is the smallest answer."""

    def __init__(self, paths: Sequence[Path], timeout_s: float, media: Mapping[str, Medium]) -> None:
        self.paths = list(paths)
        self.timeout_s = timeout_s
        #: Tier type -> medium (:func:`tier_media`): required, as a tier missing here counts as remote.
        self.media = dict(media)
        self._socks: dict[Path, socket.socket] = {}
        self._lock = threading.Lock()

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> int:
        return sum(n for _, n in self.lookup_tiers(tokens, request))

    def lookup_tiers(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]]:
        """Per chunk of the prefix every worker holds: (fastest tier holding it, tokens)."""
        message = encode_request(tokens, request)
        with self._lock:
            return merge_tiers([self._ask(path, message) for path in self.paths], self.media)

    def close(self) -> None:
        with self._lock:
            for sock in self._socks.values():
                sock.close()
            self._socks.clear()

    def inline_lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]] | None:
        """``None``: the worker answers from one thread, which a slow lookup may hold, so
        the scheduler never asks it from its own thread in background mode."""
        return None

    def reset(self) -> int:
        """Ask every worker to run its ``reset_cache``; returns the chunks removed."""
        message = encode_reset()
        with self._lock:
            return sum(int(self._exchange(path, message).get("removed", 0)) for path in self.paths)

    def _ask(self, path: Path, message: bytes) -> list[tuple[str, int]]:
        reply = self._exchange(path, message)
        return [(str(name), int(count)) for name, count in reply.get("tiers", [])]

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
                sock.sendall(_LEN.pack(len(message)) + message)
                reply: dict[str, Any] = json.loads(_recv_message(sock))
            except UnsafeSocketPathError as exc:
                raise LookupChannelError(str(exc)) from None
            except (OSError, ValueError) as exc:
                self._socks.pop(path, None)
                if sock is not None:
                    sock.close()
                if attempt == 2:
                    raise LookupChannelError(f"lookup via {path} failed: {exc}") from exc
                continue
            if "error" in reply:
                raise LookupChannelError(f"worker could not look up: {reply['error']}")
            return reply
        raise AssertionError("unreachable")


def _recv_message(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if length > _MAX_MESSAGE:
        raise ValueError(f"reply of {length} bytes is too large")
    return _recv_exact(sock, length)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < size:
        data = sock.recv(size - len(chunks))
        if not data:
            raise ConnectionError("lookup server closed the connection")
        chunks += data
    return bytes(chunks)


class DirectLookup:
    """The worker's engines live in this process: call them."""

    def __init__(
        self,
        engines: Sequence[CacheEngine],
        resets: Sequence[Callable[[], int]],
        media: Mapping[str, Medium],
        inline: Collection[str] | None = None,
        trims: Sequence[TrimHit | None] = (),
    ) -> None:
        self.engines = list(engines)
        #: Per engine, what cuts its answers short (None: nothing).
        self.trims = list(trims) or [None] * len(self.engines)
        self.resets = list(resets)
        #: Tier type -> medium (:func:`tier_media`): required, as a tier missing here counts as remote.
        self.media = dict(media)
        #: Tier types :meth:`inline_lookup` asks; by default :func:`inline_tiers` of the engines' config.
        if inline is None:
            inline = inline_tiers(self.engines[0].config) if self.engines else ()
        self.inline = frozenset(inline)

    def reset(self) -> int:
        return sum(reset() for reset in self.resets)

    def lookup(self, tokens: Sequence[int], request: RequestInfo) -> int:
        return sum(n for _, n in self.lookup_tiers(tokens, request))

    def lookup_tiers(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]]:
        answers = [engine.lookup_tiers(tokens, request=request) for engine in self.engines]
        return merge_tiers(self._trimmed(tokens, request, answers), self.media)

    def _trimmed(
        self, tokens: Sequence[int], request: RequestInfo, answers: list[list[tuple[str, int]]]
    ) -> list[list[tuple[str, int]]]:
        return [a if trim is None else trim(tokens, request, a) for trim, a in zip(self.trims, answers)]

    def inline_lookup(self, tokens: Sequence[int], request: RequestInfo) -> list[tuple[str, int]] | None:
        """The answer of :meth:`lookup_tiers` when the tiers that answer inline
        (``self.inline``: memory, local files) give it alone, without asking a slower
        tier; ``None`` when a slower tier could add to it.

        They answer alone when they hold every whole chunk of the prompt, and the last,
        partial chunk too unless the config never stores one (``save_unfull_chunk``).
        """
        answers, hits = [], []
        for engine in self.engines:
            keys = engine.chunk_keys(tokens, request)
            # A chunk is held when every record of it is (one per head group: CacheEngine.record_keys).
            count, records = engine.records.count, engine.record_keys(keys, request)
            where: list[str | None] = [None] * len(keys)
            for tier in engine.chain.tiers:
                if tier.name not in self.inline:
                    continue
                ask = [i for i, name in enumerate(where) if name is None]
                if not ask:
                    break
                try:
                    found = tier.contains([records[i * count + j] for i in ask for j in range(count)])
                except Exception:  # the lookup proper asks again, and counts the error
                    return None
                for n, i in enumerate(ask):
                    if all(found[n * count : (n + 1) * count]):
                        where[i] = tier.name
            held = next((i for i, name in enumerate(where) if name is None), len(keys))
            partial_left = held == len(keys) - 1 and keys[-1].num_tokens < engine.chunk_size
            if held < len(keys) and not (partial_left and not engine.config.save_unfull_chunk):
                return None
            answers.append([(str(name), key.num_tokens) for name, key in zip(where[:held], keys)])
            hits.append(keys[held - 1].end if held else 0)
        for engine, hit in zip(self.engines, hits):  # counted as CacheEngine.lookup_tiers counts its own
            engine.metrics.lookups.inc()
            engine.metrics.lookup_tokens.inc(len(tokens))
            engine.metrics.lookup_hit_tokens.inc(hit)
        return merge_tiers(self._trimmed(tokens, request, answers), self.media)

    def close(self) -> None:
        pass


def tier_media(config: KVPlugConfig) -> dict[str, Medium]:
    """The medium of each tier type in ``config`` (:attr:`kvplug.StorageTier.medium`), from
    the registry it was resolved against.

    Adapters treat tiers by this trait, never by their names; a type this process
    does not have counts as ``remote``, the slow and safe assumption.
    """
    classes = (config.registry or get_registry()).storage_tiers()
    return {spec.type: classes[spec.type].medium if spec.type in classes else "remote" for spec in config.tiers}


def inline_tiers(config: KVPlugConfig) -> frozenset[str]:
    """The tier types in ``config`` that answer lookups inline (:attr:`kvplug.StorageTier.inline_lookups`,
    or medium ``memory``): the scheduler asks them on its own thread, the others in the background."""
    classes = (config.registry or get_registry()).storage_tiers()
    return frozenset(
        spec.type
        for spec in config.tiers
        if spec.type in classes and (classes[spec.type].medium == "memory" or classes[spec.type].inline_lookups)
    )


def merge_tiers(answers: Sequence[list[tuple[str, int]]], media: Mapping[str, Medium]) -> list[tuple[str, int]]:
    """The prefix every tensor-parallel worker holds, each chunk with the slowest of the
    workers' answers by medium (``media``: tier type -> medium; unknown types are
    ``remote``): a chunk counts as in memory only if every worker has it in a memory tier."""
    if not answers:
        return []
    length = min(len(answer) for answer in answers)
    merged = []
    for index in range(length):
        names = sorted({answer[index][0] for answer in answers})
        name = max(names, key=lambda n: MEDIA.index(media.get(n, "remote")))
        merged.append((name, answers[0][index][1]))
    return merged
