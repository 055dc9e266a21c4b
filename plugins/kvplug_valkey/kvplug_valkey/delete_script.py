"""The compare-and-delete of :meth:`kvplug_valkey.backend.ValkeyBackend.delete_if_same`: a Lua
script, which the server runs atomically (no write of the key by any client comes between its
check and its ``DEL``), and how a server that will not run it answers."""

from __future__ import annotations

import hashlib
from typing import Any

from valkey import exceptions as vex

from kvplug import Buffer

_DELETE_IF_SAME = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if ARGV[1] == 'foreign' then
  if kind ~= 'string' or redis.call('STRLEN', KEYS[1]) == 0 then return redis.call('DEL', KEYS[1]) end
  return 0
end
if kind ~= 'string' then return 0 end
if ARGV[1] == 'longer' then
  local bound = tonumber(ARGV[2])
  if bound >= 0 and redis.call('STRLEN', KEYS[1]) > bound then return redis.call('DEL', KEYS[1]) end
  return 0
end
if redis.sha1hex(redis.call('GET', KEYS[1])) == ARGV[2] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def delete_if_same(key: bytes, seen: Buffer | None, bound: int | None) -> tuple[Any, ...]:
    """The ``EVAL`` that deletes ``key`` only if it still holds the bytes read (their SHA-1, so
    the record is not sent back), is still not a string (``seen`` empty: a foreign key), or
    (``seen`` ``None``: read as over the record bound) is still longer than ``bound``."""
    if seen is None:
        check: tuple[Any, ...] = ("longer", -1 if bound is None else bound)
    elif not memoryview(seen).nbytes:
        check = ("foreign", 0)
    else:
        check = ("sha1", hashlib.sha1(seen, usedforsecurity=False).hexdigest())
    return ("EVAL", _DELETE_IF_SAME, 1, key, *check)


def script_refused(result: BaseException) -> bool:
    """The server will not run the script for this client: an ACL without ``@scripting``
    (``NOPERM``), or ``EVAL`` renamed away (unknown command)."""
    if isinstance(result, vex.NoPermissionError):
        return True
    text = str(result).upper()
    return isinstance(result, vex.ResponseError) and (text.startswith("NOPERM") or "UNKNOWN COMMAND" in text)
