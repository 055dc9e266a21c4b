"""The bounded unix-socket message server and its private folder, now kvplug's public API.

They moved to the core (:class:`kvplug.MessageServer`, :func:`kvplug.private_socket_dir`),
where every engine adapter serves ``kvplug ctl`` with them; this module keeps the names
the lookup socket used.
"""

from __future__ import annotations

from kvplug import (
    LOOKUP_DIR_ENV,
    MessageServer,
    ServerLimits,
    check_socket_file,
    private_socket_dir,
    remove_stale_sockets,
)
from kvplug.errors import UnsafeSocketPathError

__all__ = [
    "LOOKUP_DIR_ENV",
    "MessageServer",
    "ServerLimits",
    "UnsafeSocketPathError",
    "check_socket_file",
    "private_socket_dir",
    "remove_stale_sockets",
]
