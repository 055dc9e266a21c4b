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
