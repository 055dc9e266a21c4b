"""Closing kvplug's SGLang objects when their process exits normally.

At a graceful shutdown SGLang's scheduler leaves its event loop and the process returns.
SGLang closes a HiCache storage backend then only where its HiCache tree registered its
own exit hook; the decode side's KV offload manager never does, and a radix cache has no
close at all. kvplug's store workers, async tier writers and control server are daemon
threads: without a close, writes still queued are lost and the control socket file stays
behind. Closing twice does nothing.
"""

from __future__ import annotations

import atexit
import logging
import weakref
from typing import Protocol

logger = logging.getLogger("kvplug.sglang")


class Closeable(Protocol):
    def close(self) -> None: ...


_OPEN: weakref.WeakSet[Closeable] = weakref.WeakSet()
_REGISTERED: list[bool] = []


def register_exit_hook() -> None:
    """Register the exit hook now (once per process). Exit hooks run last registered first:
    registered before SGLang builds its caches (when it loads its plugins), it runs after
    SGLang's own, which stop SGLang's storage threads before they close a backend."""
    if not _REGISTERED:
        atexit.register(_close_all)
        _REGISTERED.append(True)


def close_at_exit(thing: Closeable) -> None:
    """Call ``thing.close()`` at a normal exit of this process, unless it is gone by then."""
    register_exit_hook()
    _OPEN.add(thing)


def _close_all() -> None:
    for thing in list(_OPEN):
        try:
            thing.close()
        except Exception:
            logger.exception("kvplug: closing %s at exit failed", type(thing).__name__)
