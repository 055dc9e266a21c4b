"""KV connector hook: paged engine KV cache <-> contiguous chunk tensors."""

from __future__ import annotations

from kvplug.hookspecs.markers import hookspec


@hookspec
def kvplug_kv_connectors() -> list[type]:
    """Return the KV connector classes this plugin provides.

    Each class subclasses :class:`kvplug.KVConnector`, carries a unique
    ``name: ClassVar[str]`` (the ``connector: {type: <name>}`` of a config) and a
    pydantic ``Config`` model, and is built as ``cls(config, layout)`` with the
    :class:`kvplug.KVLayout` of the engine's cache.

    ``gather_layer`` copies the KV of the given slots of one layer out of the
    paged cache into a chunk tensor ``[num_kv, num_tokens, token_width]``;
    ``scatter_layer`` writes such a tensor back into other slots. Slots are
    ``block_id * block_size + offset``. The engine plans every chunk of a call
    at once (``plan_many``) and asks ``gather_copies``/``scatter_copies`` for the
    copies of a batch of layers, which by default are one ``gather_layer`` or
    ``scatter_layer`` per layer and chunk; a connector may return fewer, larger ones. The class method ``is_available()`` says
    whether the connector can run here; ``connector: {type: auto}`` picks the
    available one with the highest ``priority: ClassVar[int]`` (default 0).
    A device connector returns True from ``wants_pinned_frames()`` to have the
    engine page-lock its host frames, and finishes its asynchronous copies in
    ``synchronize()``.
    """
