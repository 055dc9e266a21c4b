"""Observer hook: what happened to KV chunks."""

from __future__ import annotations

from kvplug.hookspecs.markers import hookspec


@hookspec
def kvplug_on_event(event: object) -> None:
    """Observe a :class:`kvplug.KVEvent` (chunks stored, loaded, evicted, removed).

    A ``stored`` event with a ``tier`` means that tier holds the keys now (sent once an
    async tier's write landed; never for a write dropped, declined, refused or failed); one
    with ``tier=None`` is the engine handing the chunks to its tiers. ``evicted`` and
    ``removed`` name the tier the keys left. ``tier`` is the tier's type; ``tier_index``, its
    position in its engine's chain, tells two tiers of one type (two ``disk`` folders) apart.
    See :class:`kvplug.KVEvent`.

    Process-wide: an observer sees the events of every cache engine in the
    process (for metrics or audit across engines). Called synchronously on the
    thread that caused the event (often a storage worker), so an implementation
    must be quick and must not raise; exceptions are logged and swallowed. An
    engine adapter that feeds one engine's KV event stream (vLLM's or SGLang's
    ``BlockStored``/``BlockRemoved``) listens to that engine only, with
    ``CacheEngine.add_event_listener``.
    """
