"""A cluster node's replies that say a key's slot is served elsewhere (or nowhere) now: ``MOVED``
(the slot moved: the map is out of date), ``ASK`` (the slot half-way moved, the key moved
already: the map is still right), ``TRYAGAIN`` and ``CLUSTERDOWN``."""

from __future__ import annotations

from typing import Any

from valkey import exceptions as vex

_KINDS = ("MOVED", "ASK", "TRYAGAIN", "CLUSTERDOWN")


def redirected(result: Any) -> bool:
    """Whether a command's reply says its slot is served elsewhere (or nowhere) now."""
    return isinstance(result, vex.ResponseError) and str(result).upper().startswith(_KINDS)


def map_outdated(result: Any) -> bool:
    """Whether a reply is a redirection that the map is to be read again for (any but ``ASK``)."""
    return redirected(result) and not str(result).startswith("ASK ")


def target(result: Any) -> tuple[str, bool] | None:
    """The address (``host:port``) a ``MOVED``/``ASK`` reply names, and whether it was ``ASK``."""
    if not isinstance(result, vex.ResponseError):
        return None
    kind, _, rest = str(result).partition(" ")
    return (rest.partition(" ")[2], kind == "ASK") if kind in ("MOVED", "ASK") else None
