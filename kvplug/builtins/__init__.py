"""kvplug's own components, registered through the plugin manager like any plugin."""

#: Module paths registered as builtin plugins, in this order.
BUILTIN_PLUGINS = (
    "kvplug.builtins.raw_serializer",
    "kvplug.builtins.torch_connector",
)
