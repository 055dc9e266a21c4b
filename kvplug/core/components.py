"""Base classes of the four plugin concerns that need no torch.

Torch-facing bases (:class:`kvplug.Serializer`, :class:`kvplug.KVConnector`) live
in :mod:`kvplug.core.serializer` and :mod:`kvplug.core.connector`, so that a storage
plugin can import everything it needs from here without importing torch.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class ComponentConfig(BaseModel):
    """Base of every component's ``Config``: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class EmptyConfig(ComponentConfig):
    """The ``Config`` of a component that takes no options."""


class EngineAdapter:
    """Describes one serving engine's integration (vLLM, SGLang).

    The integration itself is registered with the engine by the engine's own
    plugin system; this class lets ``kvplug plugins`` list it and lets
    ``kvplug demo`` run the real engine.
    """

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = EmptyConfig
    #: Distribution name of the engine package, for version reports.
    engine_distribution: ClassVar[str] = ""

    @classmethod
    def engine_version(cls) -> str | None:
        """Installed version of the engine, or ``None`` when it is not installed."""
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(cls.engine_distribution)
        except PackageNotFoundError:
            return None

    @classmethod
    def run_demo(cls, console: Any, **options: Any) -> dict[str, Any] | None:
        """Run ``kvplug demo`` on the real engine; ``None`` means not supported."""
        return None
