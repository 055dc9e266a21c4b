"""Which ``NOPERM`` answers to a ``SET`` say that the user may not write at all.

An ACL refuses a ``SET`` for one of two reasons, which its text tells apart: the command
(``User x has no permissions to run the 'set' command``: no key can be written, so the
store's writes wait a cool-down, see :class:`kvplug.WriteRefusals`), or the key (``No
permissions to access a key``; Redis 6: ``... access one of the keys used as
arguments``): a pattern such as ``%W~kvplug:a*`` allows other keys, which go on being
written, so that record alone is refused.

Nothing a user without admin rights may ask tells a user with no write pattern at all
(``%R~*``) from one whose pattern allows some keys. So once a key was refused, the backend
asks before each SET whether the ACL lets the user write that key, without its value:
``SETRANGE key 0 ""`` needs the same write permission on the key (and read, which the tier
needs anyway) and changes nothing (an empty range on a missing key creates none).
"""

from __future__ import annotations

import re
from typing import Literal

import valkey.exceptions as vex

#: A key's refusal (Valkey, then Redis 6), matched as a phrase: a user's name has no spaces,
#: so ``User keyholder has no permissions to run ...`` is no key's refusal.
_KEY_REFUSED = re.compile(r"permissions to access (a key|one of the keys)", re.IGNORECASE)


def refused_write(result: object) -> Literal["user", "key"] | None:
    """``"user"`` where the ACL refuses the command, ``"key"`` where it refuses that key
    alone, ``None`` where ``result`` is no ACL refusal."""
    text = str(result)
    if not isinstance(result, vex.NoPermissionError) and not (
        isinstance(result, vex.ResponseError) and text.upper().startswith("NOPERM")
    ):
        return None
    return "key" if _KEY_REFUSED.search(text) else "user"


def write_probe(key: bytes) -> tuple[bytes | str | int, ...]:
    """A command the ACL checks as a write of ``key``, which changes nothing (see the module)."""
    return ("SETRANGE", key, 0, b"")
