"""Observer hook: what happened to KV chunks."""

from __future__ import annotations

from kvplug.hookspecs.markers import hookspec


@hookspec
def kvplug_on_event(event: object) -> None:
    """Observe a :class:`kvplug.KVEvent` (chunks stored, loaded, evicted, removed).

    Called synchronously on the thread that caused the event (often a storage
    worker), so an implementation must be quick and must not raise; exceptions
    are logged and swallowed. Engine adapters use it to feed their engine's KV
    event stream (SGLang's ``BlockStored``/``BlockRemoved``).
    """
