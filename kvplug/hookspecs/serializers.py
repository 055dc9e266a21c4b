"""Serializer hook: KV chunk tensor <-> bytes."""

from __future__ import annotations

from kvplug.hookspecs.markers import hookspec


@hookspec
def kvplug_serializers() -> list[type]:
    """Return the serializer classes this plugin provides.

    Each class subclasses :class:`kvplug.Serializer`, carries a unique
    ``name: ClassVar[str]`` (the ``serializer: {type: <name>}`` of a config) and a
    pydantic ``Config`` model of its options, and is built as ``cls(config)``.

    A serializer turns one chunk tensor into one bytes-like object with a
    versioned header and a checksum (``dumps``, or ``allocate`` + ``seal`` to let
    the connector gather straight into the output), and back (``loads``). ``loads``
    raises :class:`kvplug.errors.CorruptChunkError` or
    :class:`kvplug.errors.IncompatibleChunkError`, never returns a wrong tensor,
    and never unpickles anything.
    """
