"""Ports for test servers on 127.0.0.1 on a machine that runs other tests too.

A port probed free and let go can be taken by another process before a child server binds it.
A kit that binds a socket itself binds port 0 and reads the port; a kit whose child server binds
chooses with :func:`free_port`, says a start that failed for that reason with :class:`PortTaken`
(:func:`says_address_in_use` reads the child's log) and starts again through
:func:`start_on_free_ports`, on ports chosen anew, a bounded number of times.
"""

from __future__ import annotations

import contextlib
import re
import socket
from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = [
    "BIND_ATTEMPTS",
    "LOOPBACK",
    "PortTaken",
    "free_port",
    "free_ports",
    "held_port",
    "says_address_in_use",
    "start_on_free_ports",
]

LOOPBACK = "127.0.0.1"
#: Starts of a server whose port another process took before it bound, each on ports chosen anew.
BIND_ATTEMPTS = 5

#: How servers say it: Python's and Go's (``bind: address already in use``), uvicorn's
#: (``error while attempting to bind on address``), C and C++ servers' ``EADDRINUSE``.
_ADDRESS_IN_USE = re.compile(r"address already in use|errno 98\b|eaddrinuse|error while attempting to bind", re.I)

T = TypeVar("T")


class PortTaken(RuntimeError):
    """A server could not bind a port chosen for it: another process took it meanwhile."""


def says_address_in_use(text: str) -> bool:
    """Whether a server's output says that a port it was to bind is in use."""
    return _ADDRESS_IN_USE.search(text) is not None


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on 127.0.0.1 now (held together while chosen, so none
    is handed out twice). Free now only: a child server that binds one may find it taken."""
    probes = [socket.socket() for _ in range(count)]
    try:
        for probe in probes:
            probe.bind((LOOPBACK, 0))
        return [int(probe.getsockname()[1]) for probe in probes]
    finally:
        for probe in probes:
            probe.close()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (see :func:`free_ports`)."""
    return free_ports(1)[0]


def start_on_free_ports(start: Callable[[], T], choose_again: Callable[[], None], attempts: int = BIND_ATTEMPTS) -> T:
    """``start()``; each time it raises :class:`PortTaken`, ``choose_again()`` (the kit picks new
    ports) and start again, ``attempts`` starts in all; the last one's :class:`PortTaken` propagates."""
    if attempts < 1:
        raise ValueError(f"attempts must be at least 1, not {attempts}")
    for _ in range(attempts - 1):
        try:
            return start()
        except PortTaken:
            choose_again()
    return start()


@contextlib.contextmanager
def held_port() -> Iterator[int]:
    """A port of 127.0.0.1 that a listening socket holds while the block runs: for tests of a kit,
    the port another process took between the kit's choosing it and its server's bind."""
    with socket.socket() as holder:
        holder.bind((LOOPBACK, 0))
        holder.listen()
        yield int(holder.getsockname()[1])
