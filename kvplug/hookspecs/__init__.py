"""Hook specifications of kvplug, one module per plugin concern.

A plugin is a module (or object) with ``@kvplug.hookimpl`` functions named like
the specs below. Each spec's docstring is its API reference; ``docs/hooks.md``
repeats them for readers who do not read code.
"""

from __future__ import annotations

from kvplug.hookspecs import connectors, engines, events, serializers, storage
from kvplug.hookspecs.markers import PROJECT_NAME, hookimpl, hookspec

SPEC_MODULES = (serializers, storage, connectors, engines, events)

__all__ = ["PROJECT_NAME", "SPEC_MODULES", "hookimpl", "hookspec"]
