"""Plugin discovery and a typed facade over pluggy's plugin manager.

Core's builtins register through the same manager as entry-point plugins (like
pytest's default plugins); ``KVPLUG_PLUGINS`` limits which entry points load.
Core code asks ``registry.storage_tiers()`` rather than calling ``pm.hook.*``.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy

from kvplug.core.events import KVEvent
from kvplug.errors import DuplicateComponentError, InvalidComponentError, PluginLoadError
from kvplug.hookspecs import PROJECT_NAME, SPEC_MODULES

logger = logging.getLogger("kvplug.plugins")

ENTRY_POINT_GROUP = "kvplug"

#: concern -> hook name. The order is the order ``kvplug plugins`` shows them in.
CONCERN_HOOKS: dict[str, str] = {
    "serializer": "kvplug_serializers",
    "storage_tier": "kvplug_storage_tiers",
    "kv_connector": "kvplug_kv_connectors",
    "engine_adapter": "kvplug_engine_adapters",
}

#: Components that known, separately installed plugins provide (fsspec's
#: ``known_implementations``): config errors say which package to install.
KNOWN_COMPONENTS: dict[tuple[str, str], str] = {
    ("storage_tier", "cpu"): "kvplug-cpu",
    ("storage_tier", "disk"): "kvplug-disk",
    ("storage_tier", "s3"): "kvplug-s3",
    ("kv_connector", "cuda"): "kvplug-cuda",
    ("engine_adapter", "vllm"): "kvplug-vllm",
    ("engine_adapter", "sglang"): "kvplug-sglang",
}


@dataclass
class PluginInfo:
    """One loaded (or failed) plugin, as ``kvplug plugins`` shows it."""

    name: str
    distribution: str
    version: str
    builtin: bool
    components: dict[str, list[str]] = field(default_factory=dict)
    error: str | None = None


class PluginRegistry:
    """The plugin manager of one process (see :func:`get_registry`)."""

    def __init__(self, *, load_entry_points: bool = True, plugin_filter: str | None = None) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        for module in SPEC_MODULES:
            self.pm.add_hookspecs(module)
        self._infos: dict[str, PluginInfo] = {}
        self.load_errors: list[PluginLoadError] = []
        tracing = os.environ.get("KVPLUG_TRACE_PLUGINS", "") not in ("", "0")
        self._trace = logging.getLogger("kvplug.trace") if tracing else None
        self._register_builtins()
        if load_entry_points:
            if plugin_filter is None:
                plugin_filter = os.environ.get("KVPLUG_PLUGINS")
            self._load_entry_points(_parse_filter(plugin_filter))
        self._components: dict[str, dict[str, type]] | None = None
        self._origins: dict[tuple[str, str], str] = {}

    # --- registration ---------------------------------------------------------------

    def register(self, plugin: object, name: str, *, distribution: str = "(in-process)", version: str = "") -> None:
        """Register a plugin object or module by hand (tests, embedding)."""
        self.pm.register(plugin, name=name)
        self._infos[name] = PluginInfo(name, distribution, version, builtin=False)
        self._components = None

    def _register_builtins(self) -> None:
        from kvplug import __version__
        from kvplug.builtins import BUILTIN_PLUGINS

        for module_path in BUILTIN_PLUGINS:
            self.pm.register(importlib.import_module(module_path), name=module_path)
            self._infos[module_path] = PluginInfo(module_path, "kvplug", __version__, builtin=True)

    def _load_entry_points(self, allowed: set[str] | None) -> None:
        for entry_point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
            if allowed is not None and entry_point.name not in allowed:
                continue
            if self.pm.has_plugin(entry_point.name) or self.pm.is_blocked(entry_point.name):
                continue
            distribution, version = _distribution_of(entry_point)
            try:
                plugin = entry_point.load()
            except Exception as exc:  # a broken plugin must not take kvplug down
                error = PluginLoadError(entry_point.name, distribution, exc)
                logger.error("%s", error)
                self.load_errors.append(error)
                self._infos[entry_point.name] = PluginInfo(
                    entry_point.name, distribution, version, builtin=False, error=str(error)
                )
                continue
            self.pm.register(plugin, name=entry_point.name)
            self._infos[entry_point.name] = PluginInfo(entry_point.name, distribution, version, builtin=False)

    def _call(self, hook_name: str, impl: Any, **kwargs: Any) -> Any:
        """Call one plugin's implementation; with KVPLUG_TRACE_PLUGINS=1, log call and result.

        Implementations are called one by one (not through ``pm.hook``) so every
        component and every failure is attributed to the plugin that caused it.
        """
        if self._trace is None:
            return impl.function(**kwargs)
        self._trace.info("call %s(%s) on plugin %s", hook_name, kwargs or "", impl.plugin_name)
        result = impl.function(**kwargs)
        self._trace.info("  %s of %s -> %r", hook_name, impl.plugin_name, result)
        return result

    # --- typed facade ---------------------------------------------------------------

    def serializers(self) -> dict[str, type]:
        return dict(self._collect()["serializer"])

    def storage_tiers(self) -> dict[str, type]:
        return dict(self._collect()["storage_tier"])

    def kv_connectors(self) -> dict[str, type]:
        return dict(self._collect()["kv_connector"])

    def engine_adapters(self) -> dict[str, type]:
        return dict(self._collect()["engine_adapter"])

    def components(self, concern: str) -> dict[str, type]:
        return dict(self._collect()[concern])

    def origin(self, concern: str, name: str) -> str:
        """``distribution version`` that provides a component."""
        self._collect()
        return self._origins[(concern, name)]

    def plugins(self) -> list[PluginInfo]:
        self._collect()
        return sorted(self._infos.values(), key=lambda info: (not info.builtin, info.name))

    def emit(self, event: KVEvent) -> None:
        """Deliver an event to ``kvplug_on_event`` observers; their errors are logged."""
        for impl in self.pm.hook.kvplug_on_event.get_hookimpls():
            try:
                self._call("kvplug_on_event", impl, event=event)
            except Exception:
                logger.exception("kvplug_on_event of plugin %s failed", impl.plugin_name)

    def _collect(self) -> dict[str, dict[str, type]]:
        if self._components is not None:
            return self._components
        found: dict[str, dict[str, type]] = {concern: {} for concern in CONCERN_HOOKS}
        for info in self._infos.values():
            info.components = {}
        for concern, hook_name in CONCERN_HOOKS.items():
            for impl in reversed(getattr(self.pm.hook, hook_name).get_hookimpls()):
                info = self._infos.get(impl.plugin_name) or PluginInfo(impl.plugin_name, "?", "", False)
                provider = f"{info.distribution} {info.version}".strip()
                for component in self._call(hook_name, impl) or []:
                    name = _component_name(component, impl.plugin_name, hook_name)
                    if name in found[concern]:
                        raise DuplicateComponentError(concern, name, self._origins[(concern, name)], provider)
                    found[concern][name] = component
                    self._origins[(concern, name)] = provider
                    info.components.setdefault(concern, []).append(name)
        self._components = found
        return found


def _component_name(component: object, plugin: str, hook_name: str) -> str:
    name = getattr(component, "name", None)
    if not isinstance(component, type) or not isinstance(name, str) or not name:
        raise InvalidComponentError(
            f"plugin {plugin!r}: {hook_name}() must return classes with a non-empty "
            f"'name' class attribute, got {component!r}"
        )
    if not hasattr(component, "Config"):
        raise InvalidComponentError(f"plugin {plugin!r}: component {name!r} has no Config model")
    return name


def _parse_filter(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _distribution_of(entry_point: EntryPoint) -> tuple[str, str]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "?", ""
    return dist.metadata["Name"], dist.version


@functools.lru_cache(maxsize=1)
def get_registry() -> PluginRegistry:
    """The process-wide registry, built on first use. ``reset_registry`` rebuilds it."""
    return PluginRegistry()


def reset_registry() -> None:
    get_registry.cache_clear()
