"""The hook implementations of core's own components, apart from the components.

Registering them imports neither the components nor torch: each hook imports its
component when the registry first asks for that concern (a command that opens stores
never does).
"""

from __future__ import annotations

from kvplug.hookspecs import hookimpl


class RawSerializerPlugin:
    """Provides the ``raw`` serializer."""

    @hookimpl
    def kvplug_serializers(self) -> list[type]:
        from kvplug.builtins.raw_serializer import RawSerializer

        return [RawSerializer]


class TorchConnectorPlugin:
    """Provides the ``torch`` KV connector."""

    @hookimpl
    def kvplug_kv_connectors(self) -> list[type]:
        from kvplug.builtins.torch_connector import TorchConnector

        return [TorchConnector]


raw_serializer = RawSerializerPlugin()
torch_connector = TorchConnectorPlugin()
