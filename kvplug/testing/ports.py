"""Ports for test servers on 127.0.0.1 on a machine that runs other tests too.

A port probed free and let go can be taken by another process before a child server binds it.
A kit that binds a socket itself binds port 0 and reads the port; a kit whose child server binds
chooses with :func:`free_port`, says a start that failed for that reason with :class:`PortTaken`
(:func:`says_address_in_use` reads the child's log; :func:`ports_in_use` asks the ports, for a
server that does not say it) and starts again through
:func:`start_on_free_ports`, on ports chosen anew, a bounded number of times.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

__all__ = [
    "BIND_ATTEMPTS",
    "LOOPBACK",
    "PortTaken",
    "free_port",
    "free_ports",
    "held_port",
    "listening_addresses",
    "ports_in_use",
    "says_address_in_use",
    "start_on_free_ports",
]

LOOPBACK = "127.0.0.1"
#: Starts of a server whose port another process took before it bound, each on ports chosen anew.
BIND_ATTEMPTS = 5

#: How servers say it: Python's (uvicorn's too) and Go's (``bind: address already in use``), C and
#: C++ servers' ``EADDRINUSE``. (Not any failed bind: uvicorn's "error while attempting to bind"
#: also reports, say, a permission refused, which a new port would not cure.)
_ADDRESS_IN_USE = re.compile(r"address already in use|errno 98\b|eaddrinuse", re.I)

T = TypeVar("T")


class PortTaken(RuntimeError):
    """A server could not bind a port chosen for it: another process took it meanwhile."""


def says_address_in_use(text: str) -> bool:
    """Whether a server's output says that a port it was to bind is in use."""
    return _ADDRESS_IN_USE.search(text) is not None


def ports_in_use(ports: Iterable[int]) -> list[int]:
    """Those of ``ports`` a socket on 127.0.0.1 holds now: asked of a child server that exited at
    start, the ports another process took (its own sockets died with it)."""
    taken = []
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (not a closed socket's TIME_WAIT)
            try:
                probe.bind((LOOPBACK, port))
            except OSError:
                taken.append(port)
    return taken


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on, from /proc: whether a child
    server listens on its port (a connection could reach another process's socket on it)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table, width in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            address_hex, port_hex = local.split(":")
            raw = bytes.fromhex(address_hex)
            # /proc prints each 32-bit word in host (little-endian) order.
            ordered = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            family = socket.AF_INET if width == 4 else socket.AF_INET6
            found.append((socket.inet_ntop(family, ordered), int(port_hex, 16)))
    return found


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
