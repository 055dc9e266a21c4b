"""Closing kvplug's SGLang objects when their process exits normally, and removing their
control sockets when a SIGTERM ends it.

At a graceful shutdown SGLang's scheduler leaves its event loop and the process returns.
SGLang closes a HiCache storage backend then only where its HiCache tree registered its
own exit hook; the decode side's KV offload manager never does, and a radix cache has no
close at all. kvplug's store workers, async tier writers and control server are daemon
threads: without a close, writes still queued are lost and the control socket file stays
behind. Closing twice does nothing. The exit waits at most :data:`EXIT_WAIT_S` for the
closes (a tier whose writes hang, a hung mount, would hold the process forever): then it
logs what it leaves and the process exits, the writes still queued lost.

SGLang stops a server by a SIGTERM to its launcher, which asks the schedulers to exit (the
graceful path above). A SIGTERM to the whole process group (``killpg``: systemd's default
``KillMode``, a terminal) reaches the schedulers too, and a scheduler installs no handler:
the default action ends it at once, no exit hook runs. So in a process with a kvplug
control socket, a SIGTERM whose disposition is still the default first removes the socket
files (nothing more: no lock, no log, no tier write, safe wherever the main thread was
interrupted), then ends the process as the default action would. A handler someone
installed before is left alone. Queued stores are not written on that path.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any, Protocol

from kvplug.errors import UnsafeSocketPathError

logger = logging.getLogger("kvplug.sglang")


class Closeable(Protocol):
    def close(self) -> None: ...


#: The longest a normal exit waits for kvplug's closes (queued writes drained into the tiers).
EXIT_WAIT_S = 60.0

_OPEN: weakref.WeakSet[Closeable] = weakref.WeakSet()
_REGISTERED: list[bool] = []
_SIGTERM_HANDLED: list[bool] = []


def register_exit_hook() -> None:
    """Register the exit hook now (once per process). Exit hooks run last registered first:
    registered before SGLang builds its caches (when it loads its plugins), it runs after
    SGLang's own, which stop SGLang's storage threads before they close a backend."""
    if not _REGISTERED:
        atexit.register(_close_all)
        _REGISTERED.append(True)


def close_at_exit(thing: Closeable) -> None:
    """Call ``thing.close()`` at a normal exit of this process, unless it is gone by then;
    remove its control socket (``thing.control``) if a SIGTERM ends the process."""
    register_exit_hook()
    _OPEN.add(thing)
    if getattr(thing, "control", None) is not None:
        _handle_sigterm()


def _close_all() -> None:
    """Close what is open, waiting up to :data:`EXIT_WAIT_S` (:func:`within_exit_wait`)."""
    within_exit_wait(lambda: _close_each(list(_OPEN)), "closing at exit")


def within_exit_wait(close: Callable[[], None], what: str, give_up: Callable[[], int] | None = None) -> None:
    """Run ``close`` on a daemon thread and wait for it up to :data:`EXIT_WAIT_S`: a tier whose
    writes never finish must not hold SGLang's scheduler (its exit, or a storage detach)
    forever. Past that the caller goes on, and what ``close`` still waits to write is lost:
    ``give_up`` drops (and counts) it then, so the closing thread, which no one can stop
    while a tier holds it in a call, ends when that one call returns (a remote tier's
    deadline bounds it; a hung mount does not) rather than after every queued write, and
    the queued chunks' memory is freed now."""
    closing = threading.Thread(target=close, name="kvplug-close", daemon=True)
    closing.start()
    closing.join(EXIT_WAIT_S)
    if closing.is_alive():
        dropped = give_up() if give_up is not None else 0
        logger.warning(
            "kvplug: %s took over %.0f s (a tier whose writes do not finish); going on without "
            "waiting: writes still queued are lost (%d batches dropped now; the close ends when "
            "the tier's write in progress returns)",
            what,
            EXIT_WAIT_S,
            dropped,
        )


def _close_each(things: list[Closeable]) -> None:
    for thing in things:
        try:
            thing.close()
        except Exception:
            logger.exception("kvplug: closing %s at exit failed", type(thing).__name__)


def _handle_sigterm() -> None:
    """Install :func:`_on_sigterm` (once) where SIGTERM still has its default action."""
    if _SIGTERM_HANDLED or threading.current_thread() is not threading.main_thread():
        return  # signal.signal works on the main thread only
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        logger.info("kvplug: SIGTERM has a handler already; the control socket is removed at a normal exit only")
        return
    signal.signal(signal.SIGTERM, _on_sigterm)
    _SIGTERM_HANDLED.append(True)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    try:
        for thing in list(_OPEN):
            server: Any = getattr(thing, "control", None)
            if server is not None:
                server.remove_file()
    except (OSError, UnsafeSocketPathError, RuntimeError):
        # Whatever failed (RuntimeError: the set changed under us), the process must still
        # end as SIGTERM ends it; the next server in the folder removes a stale socket.
        pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the default action: the process ends as a SIGTERM ends it
