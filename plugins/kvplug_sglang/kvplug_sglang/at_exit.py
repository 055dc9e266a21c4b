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


def close_at_exit(thing: Closeable) -> None:
    """Call ``thing.close()`` at a normal exit of this process, unless it is gone by then."""
    if not _REGISTERED:
        atexit.register(_close_all)
        _REGISTERED.append(True)
    _OPEN.add(thing)


def _close_all() -> None:
    for thing in list(_OPEN):
        try:
            thing.close()
        except Exception:
            logger.exception("kvplug: closing %s at exit failed", type(thing).__name__)
