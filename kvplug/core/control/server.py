"""A running engine's answers to ``kvplug ctl``: one :class:`ControlServer` per cache engine.

An engine adapter starts one for each of its workers' :class:`~kvplug.CacheEngine`
(one per tensor-parallel rank of each pipeline stage) on :func:`control_socket_path`, in this user's private
folder; ``kvplug ctl`` finds them there, asks every rank of an engine and sums. An
adapter whose scheduler runs in another process asks the same socket (``lookup``, with
typed :class:`~kvplug.ChunkLocation` answers, and ``reset``: the adapter's cache reset,
``on_reset``). Requests are answered on several threads at once, so an operator's request
waits behind no more than the one lookup a scheduler has in flight.

The server asks a :class:`~kvplug.core.control.target.ControlTarget` (a cache engine's,
:class:`~kvplug.core.control.target.EngineControl`, by default). ``clear`` removes the
chunks this engine stored since it started (the target's journal, fed by its events) from
every tier, and those it only loaded from its private tiers alone (``trusted_reads``), never
what other engines wrote to a tier they may share: it can say exactly what it removed.
``kvplug store`` handles stores offline.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvplug.core.control.message_server import MessageServer, ServerLimits
from kvplug.core.control.protocol import (
    CONTROL_PROTOCOL_VERSION,
    MAX_CONTROL_MESSAGE,
    ControlRequest,
    VersionMismatch,
    decode_request,
    encode_reply,
    error_reply,
    text_field,
)
from kvplug.core.control.target import ClearKeys, ControlTarget, EngineControl
from kvplug.core.control_socket import private_socket_dir
from kvplug.core.engine.locations import hit_tokens
from kvplug.core.version import KVPLUG_VERSION
from kvplug.errors import ControlProtocolError

if TYPE_CHECKING:
    from kvplug.core.engine.cache_engine import CacheEngine

logger = logging.getLogger("kvplug.control")

CONTROL_LIMITS = ServerLimits(
    max_message_bytes=MAX_CONTROL_MESSAGE, max_buffered_bytes=2 * MAX_CONTROL_MESSAGE, max_connections=16
)


@dataclass(frozen=True)
class ControlIdentity:
    """Who answers on a control socket: ``kvplug ctl list`` shows it, ``--engine`` matches it."""

    #: The engine instance's id (unique per running engine); ranks of one engine share it.
    engine_id: str
    #: A name an operator knows it by (the served model name), for ``--engine NAME``.
    name: str
    #: Which adapter runs it (the engine plugin's name).
    adapter: str
    tp_rank: int = 0
    tp_size: int = 1
    dp_rank: int = 0
    #: The pipeline stage (each holds other layers, with a cache engine of its own per tensor-parallel rank).
    pp_rank: int = 0
    pp_size: int = 1

    @property
    def worker(self) -> int:
        """This rank's index among the engine's ``tp_size * pp_size`` workers (its tensor-parallel
        rank in the first stage): what its socket is named by."""
        return self.pp_rank * self.tp_size + self.tp_rank


def control_socket_path(engine_id: str, dp_rank: int, worker: int) -> Path:
    """The control socket of one worker of an engine (:attr:`ControlIdentity.worker`: the
    tensor-parallel rank without pipeline stages): this user's private folder, a hex name."""
    name = hashlib.sha256(f"{engine_id}\0{dp_rank}\0{worker}".encode()).hexdigest()[:32]
    return private_socket_dir() / f"ctl-{name}.sock"


class ControlServer(MessageServer):
    """Answers ``kvplug ctl`` for one cache engine on a unix socket.

    The socket handling (private folder, peer uid, limits, deadlines) is
    :class:`~kvplug.MessageServer`'s; the messages are :mod:`kvplug.core.control.protocol`'s.
    Requests are answered on threads of their own, several at once: a slow one (a ``clear``
    of many chunks, a ``stats`` of a slow tier) holds up only its own client.
    """

    thread_name = "kvplug-control-server"
    answer_threads = 4

    def __init__(
        self,
        target: CacheEngine | ControlTarget,
        identity: ControlIdentity,
        path: Path | None = None,
        limits: ServerLimits = CONTROL_LIMITS,
        *,
        on_reset: Callable[[], int] | None = None,
    ) -> None:
        #: What the server answers about (a cache engine is served by its :class:`EngineControl`).
        self.target = target if isinstance(target, ControlTarget) else EngineControl(target)
        made_target = self.target is not target
        self.identity = identity
        #: What a ``reset`` request runs (the adapter's cache reset: records removed); None: refused.
        self.on_reset = on_reset
        self._ops: Mapping[str, Callable[[ControlRequest], dict[str, Any]]] = {
            "info": self._info,
            "stats": self._stats,
            "tiers": self._tiers,
            "lookup": self._lookup,
            "explain": self._explain,
            "pin": self._pin,
            "unpin": self._pin,
            "clear": self._clear,
            "reset": self._reset,
        }
        self._clearing = threading.Lock()
        try:
            super().__init__(path or control_socket_path(identity.engine_id, identity.dp_rank, identity.worker), limits)
        except BaseException:
            # A target the caller made stays open: it still journals the engine's stores, which
            # the caller's own clears and resets remove (a server that failed to start leaves it as it was).
            if made_target:
                self.target.close()
            raise

    def close(self) -> None:
        super().close()
        self.target.close()

    def answer(self, body: bytes) -> bytes | None:
        try:
            request = decode_request(body)
        except VersionMismatch as exc:
            return error_reply(str(exc), "version")
        except ControlProtocolError as exc:
            logger.warning("control socket: a malformed request (%s); closing its connection", exc)
            return None
        except Exception as exc:  # a decoder bug ends this request, never the server
            logger.warning("control socket: a request that could not be read (%r); closing its connection", exc)
            return None
        try:
            return encode_reply(self._ops[request.op](request), len(request.tokens))
        except ControlProtocolError as exc:
            return error_reply(str(exc), "bad_request")
        except Exception as exc:  # the engine stays up: the operator reads why
            logger.warning("control request %s failed: %s", request.op, exc)
            return error_reply(f"{type(exc).__name__}: {exc}", "failed")

    # --- ops --------------------------------------------------------------------------

    def _info(self, request: ControlRequest) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self.identity),
            "pid": os.getpid(),
            "protocol": CONTROL_PROTOCOL_VERSION,
            "kvplug": KVPLUG_VERSION,
            **self.target.describe(),
            "tiers": [label for label, _ in self.target.chain.stats()],
        }

    def _tier_rows(self) -> list[dict[str, Any]]:
        chain = self.target.chain
        rows = []
        for (label, stats), tier, settings in zip(chain.stats(), chain.tiers, chain.settings):
            row: dict[str, Any] = {
                "tier": label,
                "medium": tier.medium,
                "max_bytes": None if settings.max_bytes is None else int(settings.max_bytes),
                **{f.name: getattr(stats, f.name) for f in dataclasses.fields(stats) if f.name != "extra"},
                "breaker_state": stats.extra.get("breaker_state", "-"),
                "extra": dict(stats.extra),
            }
            rows.append(row)
        return rows

    def _stats(self, request: ControlRequest) -> dict[str, Any]:
        # ``closed``: a closed engine's figures, not a serving one's (its closed tiers hold nothing).
        return {"metrics": self.target.metrics.snapshot(), "tiers": self._tier_rows(), "closed": self.target.closed}

    def _tiers(self, request: ControlRequest) -> dict[str, Any]:
        return {"tiers": self._tier_rows(), "closed": self.target.closed}

    def _lookup(self, request: ControlRequest) -> dict[str, Any]:
        found = self.target.locate(request.tokens, request.request_info())
        return {
            "num_tokens": len(request.tokens),
            "hit_tokens": hit_tokens(found),
            "chunks": [[location.tier, location.tokens] for location in found],
            "locations": [location.to_json() for location in found],
        }

    def _reset(self, request: ControlRequest) -> dict[str, Any]:
        if self.on_reset is None:
            raise ControlProtocolError("this engine has no cache reset")
        return {"removed": self.on_reset()}

    def _explain(self, request: ControlRequest) -> dict[str, Any]:
        return self.target.explain(request.tokens, request.request_info())

    def _pin(self, request: ControlRequest) -> dict[str, Any]:
        report = self.target.pin(request.tokens, request.request_info(), unpin=request.op == "unpin")
        return dataclasses.asdict(report)

    def _clear(self, request: ControlRequest) -> dict[str, Any]:
        """Remove the journal's chunks in the request's scope, from one tier (or all); say what.

        What this engine wrote goes from every tier; what it only loaded, only from its
        private tiers (``trusted_reads``): a tier others may share keeps their records."""
        target = self.target
        if request.fields.get("all_salts") is True and request.fields.get("lora_id") is not None:
            # A scope of every salt would silently drop the LoRA and clear every LoRA's chunks.
            raise ControlProtocolError("clear: lora_id scopes a cache_salt; all_salts clears every salt and LoRA")
        tier_name = text_field(request.fields, "tier")
        labels = [label for label, _ in target.chain.stats()]
        chosen = [index for index, label in enumerate(labels) if _tier_matches(label, tier_name)]
        if tier_name is not None and not chosen:
            raise ControlProtocolError(f"no tier {tier_name!r} in this engine; tiers: {', '.join(labels)}")
        with self._clearing:  # the bytes a clear reports freed are its own
            plan, done = target.remove(
                lambda: _clear_plan(target, request), tiers=None if tier_name is None else chosen, count=True
            )
        return {
            # A queued write cancelled is a record that leaves the tier before it got there.
            "removed": {removal.label: len({*removal.removed, *removal.cancelled}) for removal in done},
            "bytes_freed": {removal.label: removal.bytes_freed for removal in done},
            "known_chunks": len(plan.written) + len(plan.loaded),
            "only_loaded": len(plan.loaded),
            "journal_forgot": target.journal.forgotten,
            "scope": plan.scope,
        }


def _clear_plan(target: ControlTarget, request: ControlRequest) -> ClearKeys:
    plan: ClearKeys | tuple[list[str], str] = target.clear_keys(request)
    if isinstance(plan, tuple):  # a target written before ClearKeys: its keys count as its own
        return ClearKeys(list(plan[0]), [], plan[1])
    return plan


def _tier_matches(label: str, wanted: str | None) -> bool:
    """``wanted`` names a tier by its label (``1:disk``), its type (``disk``) or its index (``1``)."""
    return wanted is None or wanted in (label, *label.split(":", 1))
