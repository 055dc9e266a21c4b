"""A client of another user, for testing that a unix socket keeps other users out."""

from __future__ import annotations

import ctypes
import os
import socket
import struct
from pathlib import Path

_LEN = struct.Struct("<I")
_PR_SET_KEEPCAPS = 8
_CAPABILITY_VERSION_3 = 0x20080522
_CAP_DAC_OVERRIDE = 1


def send_as_other_user(path: Path, message: bytes, *, uid: int = 65534, dac_override: bool = False) -> str:
    """What a process of user ``uid`` (``nobody``) gets when it sends ``message`` (length-prefixed)
    to the unix socket ``path``: ``"connect <errno>"`` (it could not connect), ``"reply <first
    bytes>"`` (``b''``: closed without a reply) or ``"closed <errno>"`` (reset while sending or
    reading). Needs root (Linux): a forked child drops to ``uid`` (this interpreter may not be
    executable by that user); with ``dac_override`` it keeps ``CAP_DAC_OVERRIDE``, so file
    permissions no longer keep it out and only the server's own peer check can."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        result = "child failed"
        try:
            os.close(read_end)
            result = _as_user(path, message, uid, dac_override)
        except BaseException as exc:
            result = f"child failed: {exc!r}"
        finally:
            os.write(write_end, result.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        result = pipe.read().decode()
    os.waitpid(pid, 0)
    return result


def _as_user(path: Path, message: bytes, uid: int, dac_override: bool) -> str:  # pragma: no cover - child
    libc = ctypes.CDLL(None, use_errno=True)
    if dac_override:
        libc.prctl(_PR_SET_KEEPCAPS, 1, 0, 0, 0)  # setuid keeps the permitted capabilities
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if dac_override:  # capset(v3, this process): effective = permitted = {CAP_DAC_OVERRIDE}
        header = (ctypes.c_uint32 * 2)(_CAPABILITY_VERSION_3, 0)
        bit = 1 << _CAP_DAC_OVERRIDE
        data = (ctypes.c_uint32 * 6)(bit, bit, 0, 0, 0, 0)
        if libc.capset(header, data) != 0:
            raise OSError(ctypes.get_errno(), "capset failed")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        try:
            sock.connect(str(path))
        except OSError as exc:
            return f"connect {exc.errno}"
        try:
            sock.sendall(_LEN.pack(len(message)) + message)
            return f"reply {sock.recv(100)!r}"
        except OSError as exc:
            return f"closed {exc.errno}"
