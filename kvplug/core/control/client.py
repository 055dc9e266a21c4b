"""The client side of ``kvplug ctl``: find running engines, ask every rank of one.

Every rank of a running engine answers on a ``ctl-*.sock`` in this user's private folder
(:mod:`kvplug.core.control.server`). :func:`find_ranks` asks each socket there who it is
(``info``); :func:`select_engine` picks one engine's ranks by its id (or a prefix) or
name; :meth:`ControlClient.ask_all` sends one request to each rank. A socket nobody
answers on (a killed engine) is skipped and reported.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvplug.core.control.protocol import encode_request, exchange
from kvplug.core.control_socket import check_socket_file, private_socket_dir
from kvplug.errors import ControlError, UnsafeSocketPathError

#: The shortest wait (and first pause between tries to connect to a busy engine).
_MIN_WAIT_S = 0.01
#: The longest pause between two tries to connect.
_MAX_RETRY_PAUSE_S = 0.2


@dataclass(frozen=True)
class RankEndpoint:
    """One rank's control socket and what it said of itself (``info``)."""

    path: Path
    info: Mapping[str, Any]

    @property
    def engine_id(self) -> str:
        return str(self.info.get("engine_id", ""))

    @property
    def rank(self) -> tuple[int, int, int]:
        """Data-parallel rank, pipeline stage, tensor-parallel rank."""
        return int(self.info.get("dp_rank", 0)), int(self.info.get("pp_rank", 0)), int(self.info.get("tp_rank", 0))

    @property
    def name(self) -> str:
        """``dp0/tp1``; ``dp0/pp1/tp0`` in an engine of pipeline stages."""
        return _rank_name(*self.rank, pipeline=int(self.info.get("pp_size", 1)) > 1)


def _rank_name(dp: int, pp: int, tp: int, *, pipeline: bool) -> str:
    return f"dp{dp}/pp{pp}/tp{tp}" if pipeline else f"dp{dp}/tp{tp}"


def missing_ranks(ranks: Sequence[RankEndpoint]) -> list[str]:
    """The names of the ranks that one engine's ``ranks`` say it has (``pp_size`` stages of
    ``tp_size`` ranks in each data-parallel rank seen) but that are not among them: ranks whose
    control socket is gone or did not answer. The engine's own lookups ask every rank and miss
    while one is missing; what ``kvplug ctl`` does reaches only the ranks it finds."""
    tp_size = max((int(r.info.get("tp_size", 1)) for r in ranks), default=1)
    pp_size = max((int(r.info.get("pp_size", 1)) for r in ranks), default=1)
    present = {r.rank for r in ranks}
    expected = [
        (dp, pp, tp) for dp in sorted({r.rank[0] for r in ranks}) for pp in range(pp_size) for tp in range(tp_size)
    ]
    return [_rank_name(*rank, pipeline=pp_size > 1) for rank in expected if rank not in present]


@dataclass
class Found:
    """The ranks that answered, and the sockets that did not (path -> why)."""

    ranks: list[RankEndpoint]
    unreachable: dict[str, str] = field(default_factory=dict)


def ask(path: Path, op: str, fields: Mapping[str, Any] | None = None, tokens: Sequence[int] = (), *,
        timeout_s: float = 30.0) -> dict[str, Any]:  # fmt: skip
    """One request to one socket; :class:`ControlError` when it cannot be answered within
    ``timeout_s`` (connecting and answering together) or the engine replied with an error."""
    try:
        check_socket_file(path)
    except (UnsafeSocketPathError, ConnectionRefusedError) as exc:
        raise ControlError(str(exc)) from None
    deadline = time.monotonic() + timeout_s
    with _connect(path, deadline, timeout_s) as sock:
        sock.settimeout(max(deadline - time.monotonic(), _MIN_WAIT_S))
        try:
            reply = exchange(sock, encode_request(op, fields, tokens))
        except ControlError as exc:
            if isinstance(exc.__cause__, TimeoutError):
                raise ControlError(f"{path} did not answer within {timeout_s:g} s") from None
            raise
    if "error" in reply:
        raise ControlError(f"{path.name}: {reply['error']}")
    return reply


def _connect(path: Path, deadline: float, timeout_s: float) -> socket.socket:
    """A connection to ``path``. While the server's backlog is full (it is busy and accepts no
    one now: the kernel answers EAGAIN), try again until ``deadline``."""
    pause = _MIN_WAIT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), _MIN_WAIT_S))
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            sock.close()
        except OSError as exc:
            sock.close()
            raise ControlError(f"cannot connect to {path}: {exc.strerror or exc}") from None
        left = deadline - time.monotonic()
        if left <= 0:
            raise ControlError(
                f"{path} did not accept a connection within {timeout_s:g} s: the engine is busy "
                "(its backlog of waiting connections is full); try again or pass a longer --timeout"
            )
        time.sleep(min(pause, left))
        pause = min(2 * pause, _MAX_RETRY_PAUSE_S)


def find_ranks(folder: Path | None = None, *, timeout_s: float = 5.0) -> Found:
    """Every rank answering on a control socket in ``folder`` (default: this user's
    private folder), ordered by engine, data-parallel rank, pipeline stage and tensor-parallel rank."""
    folder = folder or private_socket_dir()
    found = Found([])
    for path in sorted(folder.glob("ctl-*.sock")):
        try:
            found.ranks.append(RankEndpoint(path, ask(path, "info", timeout_s=timeout_s)))
        except ControlError as exc:
            found.unreachable[str(path)] = str(exc)
    found.ranks.sort(key=lambda r: (r.engine_id, r.rank))
    return found


def select_engine(ranks: Sequence[RankEndpoint], wanted: str | None) -> list[RankEndpoint]:
    """The ranks of the engine ``wanted`` names (its id, a prefix of it, or its name);
    with ``None``, of the only engine running. :class:`ControlError` names the engines
    when there is none or more than one to choose from."""
    engines: dict[str, list[RankEndpoint]] = {}
    for rank in ranks:
        engines.setdefault(rank.engine_id, []).append(rank)
    if wanted is None:
        chosen = list(engines)
    else:
        chosen = [e for e, rs in engines.items() if e == wanted or rs[0].info.get("name") == wanted]
        chosen = chosen or [e for e in engines if e.startswith(wanted)]
    if len(chosen) == 1:
        return engines[chosen[0]]
    listing = ", ".join(f"{e} ({rs[0].info.get('name')})" for e, rs in engines.items()) or "none"
    if not chosen:
        what = "no engine is running" if wanted is None else f"no engine matches {wanted!r}"
        raise ControlError(f"{what}; engines: {listing}")
    raise ControlError(f"{len(chosen)} engines match: pass --engine ID or NAME; engines: {listing}")


class ControlClient:
    """Sends requests to every rank of one engine."""

    def __init__(self, ranks: Sequence[RankEndpoint], timeout_s: float = 30.0) -> None:
        self.ranks = list(ranks)
        self.timeout_s = timeout_s
        #: The engine's ranks not among ``ranks`` (:func:`missing_ranks`): requests do not reach them.
        self.missing = missing_ranks(self.ranks)

    def ask_all(
        self, op: str, fields: Mapping[str, Any] | None = None, tokens: Sequence[int] = ()
    ) -> list[tuple[RankEndpoint, dict[str, Any]]]:
        """Each rank's reply, in rank order; the first rank that fails raises :class:`ControlError`,
        which names the ranks that answered before it: a pin or clear is done on those."""
        replies: list[tuple[RankEndpoint, dict[str, Any]]] = []
        for rank in self.ranks:
            try:
                replies.append((rank, ask(rank.path, op, fields, tokens, timeout_s=self.timeout_s)))
            except ControlError as exc:
                if not replies:
                    raise
                done = ", ".join(r.name for r, _ in replies)
                failed = rank.name
                raise ControlError(
                    f"rank {failed}: {exc}; {op} was done on the ranks that answered first: {done}"
                ) from None
        return replies
