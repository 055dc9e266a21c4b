"""Storage tier hook: opaque bytes under hex string keys."""

from __future__ import annotations

from kvplug.hookspecs.markers import hookspec


@hookspec
def kvplug_storage_tiers() -> list[type]:
    """Return the storage tier classes this plugin provides.

    Each class subclasses :class:`kvplug.StorageTier`, carries a unique
    ``name: ClassVar[str]`` (the ``tiers: [{type: <name>}]`` of a config) and a
    ``Config`` model subclassing :class:`kvplug.TierConfig` (the shared
    ``max_bytes`` and write options the tier chain reads; the registry refuses a
    plugin whose tier's ``Config`` does not), and is built as
    ``cls(config, context)`` with a :class:`kvplug.TierContext`. It declares its
    ``medium`` (``"memory"``, ``"disk"`` or ``"remote"``; undeclared: ``"remote"``):
    engine adapters treat tiers by it, never by their names. A constructor that
    fails raises; the core reports it as ``TierOpenError`` naming ``tiers[i]``.

    A tier sees bytes only (it must not import torch). Its methods are batched:
    ``contains(keys)``, ``get(keys)``, ``put(items)``, ``remove(keys)``,
    ``stats()``, ``close()``. A ``put`` is atomic per key: a reader sees the whole
    value or nothing. Run :class:`kvplug.testing.StorageTierContract` against it.
    """
