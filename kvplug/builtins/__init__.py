"""kvplug's own components, registered through the plugin manager like any plugin
(``kvplug.core.plugins.BUILTIN_PLUGINS`` names them)."""
