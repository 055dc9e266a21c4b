"""A module imported on first use, for component modules that must load without torch.

``kvplug plugins`` and ``kvplug config validate`` import every installed component's
module to read its name and ``Config``; importing torch costs seconds. A module that
uses torch only inside its functions binds ``torch`` to a :class:`LazyModule` at run
time (and imports torch for the type checker alone)::

    if TYPE_CHECKING:
        import torch
    else:
        torch = LazyModule("torch")
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any


class LazyModule:
    """Stands for module ``name``, which it imports on the first attribute use.

    Nothing goes into ``sys.modules`` before that use. Each attribute read is kept on the
    instance, so later reads (a connector's per-chunk ``torch.empty``) cost what reading a
    module's attribute costs, not an import lookup.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        # Only called for names not yet kept on the instance.
        if attribute.startswith("__") and attribute.endswith("__"):
            # Protocol lookups (copy, pickle, inspect) must not import the module.
            raise AttributeError(attribute)
        value = getattr(import_module(self._name), attribute)
        setattr(self, attribute, value)
        return value

    def __repr__(self) -> str:
        return f"<module {self._name!r}, imported on first use>"


def lazy_exports(module: str, names: Mapping[str, str | tuple[str, str]]) -> Callable[[str], Any]:
    """A package's module ``__getattr__`` that imports each exported name's module on its
    first use, so registering a plugin (every ``kvplug`` command imports every installed
    plugin's package) imports none of them, nor what they import (torch)::

        __getattr__ = kvplug.lazy_exports(__name__, {"MyTier": "my_plugin.tier"})

    ``names`` maps an exported name to the module that defines it under the same name, or
    to ``(module, name there)``. The value is then kept on the package: later uses do not
    come back here. Any other name is an :class:`AttributeError` naming the package.
    """

    def __getattr__(name: str) -> Any:
        where = names.get(name)
        if where is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        source, attribute = where if isinstance(where, tuple) else (where, name)
        value = getattr(import_module(source), attribute)
        setattr(sys.modules[module], name, value)
        return value

    return __getattr__
