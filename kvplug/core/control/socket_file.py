"""The socket file a :class:`~kvplug.core.control.message_server.MessageServer` listens on.

It is bound only in a private folder (:mod:`kvplug.core.control_socket`), never over a
socket another running process serves, and removed at close only while it is still the
file this process bound: a server that took over a stale path keeps it.
"""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from kvplug.core.control_socket import _check_private, remove_stale_sockets
from kvplug.errors import SocketInUseError, UnsafeSocketPathError


def bind_private_socket(path: Path) -> tuple[socket.socket, int]:
    """A unix socket bound at ``path`` (mode 0600) and the inode of its file, for
    :func:`remove_socket_file`. A stale socket or a link at ``path`` is replaced; anything
    else there, a live server's socket or a folder that is not private, is refused."""
    problem = _check_private(path.parent)
    if problem:
        raise UnsafeSocketPathError(f"refusing to serve in {path.parent}: {problem}")
    remove_stale_sockets(path.parent)
    _refuse_served(path)
    remove_socket_file(path, None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
        os.chmod(path, 0o600, follow_symlinks=False)
        return listener, os.lstat(path).st_ino
    except BaseException:
        listener.close()
        raise


def remove_socket_file(path: Path, inode: int | None) -> None:
    """Remove the socket (or link) at ``path`` if it is the file of ``inode`` (``None``: any
    socket); :class:`UnsafeSocketPathError` if something else is there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode) and not stat.S_ISLNK(info.st_mode):
        raise UnsafeSocketPathError(f"{path} exists and is not a socket; not removing it")
    if inode is not None and info.st_ino != inode:
        return  # another server's socket now (ours was removed as stale): not ours to remove
    path.unlink(missing_ok=True)  # a link itself is removed, never its target


def _refuse_served(path: Path) -> None:
    """:class:`SocketInUseError` when a process listens on the socket at ``path``: replacing
    it would cut that process off from its clients (and its close would remove ours)."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        return  # not a socket: remove_socket_file names it
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return  # nobody listens: a stale socket, replaced
        except OSError:
            pass  # a full backlog or a slow server: someone listens
    raise SocketInUseError(f"{path} is served by another running process; not taking it over")
