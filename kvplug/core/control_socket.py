"""The private folder of the unix sockets a running engine answers on, and checks of their peers.

An engine adapter's worker answers on unix sockets: its scheduler's lookups, and the
operator's ``kvplug ctl`` (:mod:`kvplug.core.control.server`), served by
:class:`~kvplug.core.control.message_server.MessageServer`.

The sockets live in a folder only this user can enter: ``$KVPLUG_LOOKUP_DIR`` if
set, else ``$XDG_RUNTIME_DIR/kvplug``, else ``<tmp>/kvplug-<uid>``; a candidate that
is a link, owned by another user or open to others is refused, and then a fresh
``mkdtemp`` folder is used and exported as ``$KVPLUG_LOOKUP_DIR`` so that the
processes this one starts (an engine's workers) find the same folder. On Linux
:func:`foreign_peer` names a connecting process of another user (``SO_PEERCRED``).
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import struct
import tempfile
import threading
import time
from pathlib import Path

from kvplug.errors import UnsafeSocketPathError

logger = logging.getLogger("kvplug.socket")

LOOKUP_DIR_ENV = "KVPLUG_LOOKUP_DIR"


# --- the private folder --------------------------------------------------------------------

_dir_lock = threading.Lock()
_dir: Path | None = None


def private_socket_dir() -> Path:
    """This user's private folder for kvplug's sockets (resolved once per process; see the module doc)."""
    global _dir
    with _dir_lock:
        # Resolved again when the variable was changed or removed since: the processes this one
        # starts read the variable, and must find the folder this process serves in.
        if _dir is not None and os.environ.get(LOOKUP_DIR_ENV) == str(_dir):
            return _dir
        _dir = _resolve_dir()
        os.environ[LOOKUP_DIR_ENV] = str(_dir)  # the processes this one starts use the same folder
        return _dir


def _resolve_dir() -> Path:
    explicit = os.environ.get(LOOKUP_DIR_ENV)
    if explicit:
        problem = _make_private(Path(explicit))
        if problem:
            raise UnsafeSocketPathError(f"{LOOKUP_DIR_ENV}={explicit} cannot hold kvplug sockets: {problem}")
        return Path(explicit)
    candidates = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and not _check_private(Path(runtime)):
        candidates.append(Path(runtime) / "kvplug")
    candidates.append(Path(tempfile.gettempdir()) / f"kvplug-{os.getuid()}")
    for candidate in candidates:
        problem = _make_private(candidate)
        if not problem:
            return candidate
        logger.warning("not using %s for kvplug sockets: %s; using a fresh private folder", candidate, problem)
    return Path(tempfile.mkdtemp(prefix=f"kvplug-{os.getuid()}-"))  # mode 0700 by construction


def _make_private(folder: Path) -> str | None:
    """Create ``folder`` (0700) if missing; what is wrong with it, or ``None``."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return f"cannot create it ({exc.strerror})"
    return _check_private(folder)


def _check_private(folder: Path) -> str | None:
    try:
        info = os.lstat(folder)
    except OSError as exc:
        return f"cannot inspect it ({exc.strerror})"
    if stat.S_ISLNK(info.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISDIR(info.st_mode):
        return "it is not a folder"
    if info.st_uid != os.getuid():
        return f"it is owned by uid {info.st_uid}, not {os.getuid()}"
    if info.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(info.st_mode):o}; others may enter it (want 700)"
    return None


def check_socket_file(path: Path) -> None:
    """Refuse to connect to anything but a socket this user owns, inside a private folder."""
    problem = _check_private(path.parent)
    if problem is None:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            raise ConnectionRefusedError(f"no kvplug socket at {path}") from None
        if not stat.S_ISSOCK(info.st_mode):
            problem = "it is not a socket" + (" (a symbolic link)" if stat.S_ISLNK(info.st_mode) else "")
        elif info.st_uid != os.getuid():
            problem = f"it is owned by uid {info.st_uid}"
    if problem:
        raise UnsafeSocketPathError(f"refusing socket {path}: {problem}")


def remove_stale_sockets(folder: Path, *, min_age_s: float = 60.0) -> None:
    """Remove sockets nobody listens on (their worker was killed, e.g. SIGKILL).

    Only sockets of this user, older than ``min_age_s`` (a worker starting right now
    has bound its socket but may not listen yet); links are never followed.
    """
    now = time.time()
    for candidate in folder.glob("*.sock"):
        try:
            info = os.lstat(candidate)
        except OSError:
            continue
        if not stat.S_ISSOCK(info.st_mode) or info.st_uid != os.getuid() or now - info.st_mtime < min_age_s:
            continue
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(candidate))
            except ConnectionRefusedError:
                candidate.unlink(missing_ok=True)
            except OSError:
                pass


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def foreign_peer(sock: socket.socket) -> str | None:
    """Why the process at the other end of ``sock`` may not talk to us (another user), or
    ``None``. The private folder already keeps other users out; this holds even if a
    process of theirs got through it (a capability, a folder opened by mistake).
    Where the platform has no ``SO_PEERCRED`` the folder alone decides."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:  # pragma: no cover - not Linux
        return None
    try:
        pid, uid, _ = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, option, _PEERCRED.size))
    except OSError as exc:
        return f"cannot read its credentials ({exc.strerror})"
    if uid != os.getuid():
        return f"process {pid} runs as uid {uid}, not {os.getuid()}"
    return None
