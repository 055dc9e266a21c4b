"""``torch``, imported when first used.

The serializers' modules load without torch: ``kvplug config validate`` and
``kvplug plugins`` read their ``Config`` and names, and importing torch costs seconds.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any


class LazyModule:
    """A module imported on first attribute access (not put in ``sys.modules`` before)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(import_module(self._name), attribute)


torch = LazyModule("torch")
