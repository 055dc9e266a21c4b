"""Plugin discovery and a typed facade over pluggy's plugin manager.

Core's builtins register through the same manager as entry-point plugins (like
pytest's default plugins); ``KVPLUG_PLUGINS`` limits which entry points load.
Core code asks ``registry.storage_tiers()`` rather than calling ``pm.hook.*``.

A plugin is used only if it fits: its distribution's requirement on ``kvplug``
admits this version (the plugin API follows semantic versions: plugins declare
``kvplug>=0.2,<0.3``), every hook it implements exists (pluggy's
``check_pending``), and its hooks do not raise. A plugin that does not fit is
reported by name in ``load_errors`` and ``kvplug plugins``; the others still load.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import sys
from dataclasses import dataclass, field
from importlib.metadata import Distribution, EntryPoint, entry_points
from typing import TYPE_CHECKING, Any, cast

import pluggy
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from kvplug.core.components import EngineAdapter
from kvplug.core.concerns import CONCERNS, CONCERNS_BY_KEY
from kvplug.core.events import KVEvent
from kvplug.core.tier import MEDIA, StorageTier, TierConfig
from kvplug.core.version import KVPLUG_VERSION
from kvplug.errors import ConfigError, ConfigProblem, DuplicateComponentError, PluginLoadError, PluginRejectedError
from kvplug.hookspecs import PROJECT_NAME, SPEC_MODULES

if TYPE_CHECKING:
    from kvplug.core.connector import KVConnector
    from kvplug.core.serializer import Serializer

logger = logging.getLogger("kvplug.plugins")

ENTRY_POINT_GROUP = "kvplug"

#: concern -> hook name, from :data:`kvplug.core.concerns.CONCERNS` (which orders them
#: as ``kvplug plugins`` shows them).
CONCERN_HOOKS: dict[str, str] = {concern.key: concern.hook for concern in CONCERNS}

#: ``(concern, component) -> package`` of kvplug's separately installed components, from
#: :data:`kvplug.core.concerns.CONCERNS`: config errors say which package to install.
KNOWN_COMPONENTS: dict[tuple[str, str], str] = {
    (concern.key, name): package for concern in CONCERNS for name, package in concern.known.items()
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


#: Core's own components (``kvplug.builtins``), registered as plugins in this order: the
#: plugin's name (its component's module) -> ``module:object`` of its hooks. Named, like
#: entry points, not imported: the builtins build on the core.
BUILTIN_PLUGINS = {
    "kvplug.builtins.raw_serializer": "kvplug.builtins.hooks:raw_serializer",
    "kvplug.builtins.torch_connector": "kvplug.builtins.hooks:torch_connector",
}


#: The values of a flag variable (``KVPLUG_TRACE_PLUGINS``), in any case.
_FLAGS = {
    "": False,
    "0": False,
    "false": False,
    "no": False,
    "off": False,
    "1": True,
    "true": True,
    "yes": True,
    "on": True,
}


def trace_plugins() -> bool:
    """Whether ``KVPLUG_TRACE_PLUGINS`` asks for pluggy's trace of every hook call. A value that
    is no flag is a :class:`ConfigError` naming it: anything but ``0`` traced, ``false`` too."""
    value = os.environ.get("KVPLUG_TRACE_PLUGINS", "")
    flag = _FLAGS.get(value.strip().lower())
    if flag is None:
        message = "must be 1, true, yes or on (log every hook call), or 0, false, no, off or empty"
        raise ConfigError([ConfigProblem("env KVPLUG_TRACE_PLUGINS", value, message)], "environment")
    return flag


class PluginRegistry:
    """The plugin manager of one process (see :func:`get_registry`)."""

    def __init__(self, *, load_entry_points: bool = True, plugin_filter: str | None = None) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        for module in SPEC_MODULES:
            self.pm.add_hookspecs(module)
        self._infos: dict[str, PluginInfo] = {}
        self.load_errors: list[PluginLoadError | PluginRejectedError] = []
        if trace_plugins():
            # pluggy's own hook-call monitoring: every call, its arguments and its result.
            self.pm.trace.root.setwriter(logging.getLogger("kvplug.trace").info)
            self.pm.enable_tracing()
        self._callers: dict[tuple[str, str], Any] = {}
        self._register_builtins()
        if load_entry_points:
            if plugin_filter is None:
                plugin_filter = os.environ.get("KVPLUG_PLUGINS")
            self._load_entry_points(_parse_filter(plugin_filter))
        self._components: dict[str, dict[str, type]] = {}
        self._provided: dict[str, dict[str, list[type]] | None] = {}
        self._origins: dict[tuple[str, str], str] = {}

    # --- registration ---------------------------------------------------------------

    def register(self, plugin: object, name: str, *, distribution: str = "(in-process)", version: str = "") -> bool:
        """Register a plugin object or module by hand (tests, embedding).

        ``False`` (and an entry in ``load_errors``) when the plugin implements a hook
        kvplug does not define, or with a signature that does not match the spec.
        """
        self._components = {}
        self._provided = {}
        return self._add(plugin, name, PluginInfo(name, distribution, version, builtin=False))

    def _add(self, plugin: object, name: str, info: PluginInfo) -> bool:
        self._infos[name] = info
        self._callers.clear()  # a subset caller made before knows nothing of this plugin
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()  # a misspelled hook name is an error, not silence
        except pluggy.PluginValidationError as exc:
            if self.pm.has_plugin(name):
                self.pm.unregister(name=name)
            self._reject(info, f"{exc}")
            return False
        return True

    def _reject(self, info: PluginInfo, reason: str) -> None:
        self._fail(info, PluginRejectedError(info.name, info.distribution, reason))

    def _fail(self, info: PluginInfo, error: PluginLoadError | PluginRejectedError) -> None:
        """Record why a plugin is not used: logged, in ``load_errors`` and on its ``kvplug plugins`` row."""
        logger.error("%s", error)
        self.load_errors.append(error)
        info.error = str(error)
        self._infos[info.name] = info

    def _register_builtins(self) -> None:
        for name, target in BUILTIN_PLUGINS.items():
            module_path, attribute = target.split(":")
            self._add(
                getattr(importlib.import_module(module_path), attribute),
                name,
                PluginInfo(name, "kvplug", KVPLUG_VERSION, builtin=True),
            )

    def _load_entry_points(self, allowed: set[str] | None) -> None:
        for entry_point in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name):
            if allowed is not None and entry_point.name not in allowed:
                continue
            if self.pm.has_plugin(entry_point.name) or self.pm.is_blocked(entry_point.name):
                continue
            info = PluginInfo(entry_point.name, *_distribution_of(entry_point), builtin=False)
            incompatible = _api_mismatch(getattr(entry_point, "dist", None))
            if incompatible:
                self._reject(info, incompatible)
                continue
            try:
                plugin = entry_point.load()
            except Exception as exc:  # a broken plugin must not take kvplug down
                self._fail(info, PluginLoadError(info.name, info.distribution, exc))
                continue
            self._add(plugin, info.name, info)

    def _call(self, hook_name: str, plugin_name: str, **kwargs: Any) -> Any:
        """Call one plugin's implementation of a hook, through pluggy (so its tracing
        sees the call), so every component and every failure is attributed to the
        plugin that caused it."""
        caller = self._callers.get((hook_name, plugin_name))
        if caller is None:
            others = [plugin for name, plugin in self.pm.list_name_plugin() if name != plugin_name]
            caller = self.pm.subset_hook_caller(hook_name, remove_plugins=others)
            self._callers[(hook_name, plugin_name)] = caller
        results = caller(**kwargs)
        return results[0] if results else None

    # --- typed facade ---------------------------------------------------------------

    def serializers(self) -> dict[str, type[Serializer]]:
        return cast("dict[str, type[Serializer]]", self.components("serializer"))

    def storage_tiers(self) -> dict[str, type[StorageTier]]:
        return cast("dict[str, type[StorageTier]]", self.components("storage_tier"))

    def kv_connectors(self) -> dict[str, type[KVConnector]]:
        return cast("dict[str, type[KVConnector]]", self.components("kv_connector"))

    def engine_adapters(self) -> dict[str, type[EngineAdapter]]:
        return cast("dict[str, type[EngineAdapter]]", self.components("engine_adapter"))

    def components(self, concern: str) -> dict[str, type[Any]]:
        return dict(self._collect(concern))

    def origin(self, concern: str, name: str) -> str:
        """``distribution version`` that provides a component."""
        self._collect(concern)
        return self._origins[(concern, name)]

    def plugins(self) -> list[PluginInfo]:
        for concern in CONCERN_HOOKS:
            self._collect(concern)
        return sorted(self._infos.values(), key=lambda info: (not info.builtin, info.name))

    def emit(self, event: KVEvent) -> None:
        """Deliver an event to ``kvplug_on_event`` observers; their errors are logged."""
        for impl in self.pm.hook.kvplug_on_event.get_hookimpls():
            try:
                self._call("kvplug_on_event", impl.plugin_name, event=event)
            except Exception:
                logger.exception("kvplug_on_event of plugin %s failed", impl.plugin_name)

    def _collect(self, concern: str) -> dict[str, type]:
        """The components of one concern, asking only the plugins that implement its hook.

        A concern is collected when first asked for: a command that needs tiers alone never
        imports the serializers and connectors (and torch, which they import).
        """
        found = self._components.get(concern)
        if found is not None:
            return found
        found = {}
        for impl in reversed(getattr(self.pm.hook, CONCERN_HOOKS[concern]).get_hookimpls()):
            provided = self._provided_by(impl.plugin_name)
            if provided is None:
                continue
            info = self._infos[impl.plugin_name]
            source = f"{info.distribution} {info.version}".strip()
            for component in provided.get(concern, []):
                name = component.name  # type: ignore[attr-defined]  # checked by _component_problem
                if name in found:
                    raise DuplicateComponentError(concern, name, self._origins[(concern, name)], source)
                found[name] = component
                self._origins[(concern, name)] = source
                info.components.setdefault(concern, []).append(name)
        self._components[concern] = found
        return found

    def _provided_by(self, plugin_name: str) -> dict[str, list[type]] | None:
        """Every component one plugin provides, by concern; ``None`` when it is refused.

        All of a plugin's hooks are asked together: a plugin that gets one component wrong
        provides none (like one built for another API).
        """
        if plugin_name in self._provided:
            return self._provided[plugin_name]
        info = self._infos.get(plugin_name)
        if info is None:
            info = self._infos[plugin_name] = PluginInfo(plugin_name, "?", "", False)
        info.components = {}
        plugin = self.pm.get_plugin(plugin_name)
        provided: dict[str, list[type]] = {}
        refused = False
        for concern, hook_name in CONCERN_HOOKS.items():
            if not any(impl.plugin is plugin for impl in getattr(self.pm.hook, hook_name).get_hookimpls()):
                continue
            try:
                components = list(self._call(hook_name, plugin_name) or [])
            except Exception as exc:  # a broken plugin must not take the others down
                self._reject(info, f"{hook_name}() raised {type(exc).__name__}: {exc}")
                refused = True
                continue
            for component in components:
                problem = _component_problem(concern, hook_name, component)
                if problem is not None:
                    self._reject(info, problem)
                    refused = True
            provided[concern] = components
        self._provided[plugin_name] = None if refused else provided
        return self._provided[plugin_name]


#: concern -> ``(module, class)`` of the base class every component of it subclasses,
#: from :data:`kvplug.core.concerns.CONCERNS`.
CONCERN_BASES: dict[str, tuple[str, str]] = {concern.key: concern.base for concern in CONCERNS}


def _missing_base(concern: str, component: type) -> str | None:
    """The base class ``component`` must subclass to serve ``concern`` and does not, or ``None``.

    Core calls a component's optional methods and reads its class attributes (a tier's
    ``location_config``, ``keeps_buffers``) through the base's defaults: a look-alike
    class that only implements the required methods breaks commands it has nothing to do
    with. The base's module is looked up in ``sys.modules``, never imported (the
    serializer and connector bases import torch): a subclass has imported it already.
    """
    module_name, class_name = CONCERN_BASES[concern]
    module = sys.modules.get(module_name)
    base = getattr(module, class_name, None) if module is not None else None
    if isinstance(base, type) and issubclass(component, base):
        return None
    return f"kvplug.{class_name}"


def _component_problem(concern: str, hook_name: str, component: object) -> str | None:
    """Why ``component`` cannot serve ``concern`` (the plugin that returned it is refused), or ``None``.

    A reason, not an exception: one plugin's bad component must not take down
    ``serializers()``, the other plugins and every command.
    """
    name = getattr(component, "name", None)
    if not isinstance(component, type) or not isinstance(name, str) or not name:
        return f"{hook_name}() must return classes with a non-empty 'name' class attribute, got {component!r}"
    word = CONCERNS_BY_KEY[concern].label
    if not hasattr(component, "Config"):
        return f"its {word} {name!r} has no Config model"
    if concern == "storage_tier":
        medium, config = getattr(component, "medium", "remote"), component.Config
        if medium not in MEDIA:
            return f"its {word} {name!r} declares medium {medium!r}; a tier's medium is one of {', '.join(MEDIA)}"
        if not (isinstance(config, type) and issubclass(config, TierConfig)):
            return (
                f"its {word} {name!r} has a Config ({getattr(config, '__qualname__', config)}) that does not "
                "subclass kvplug.TierConfig, which holds the settings every tier has (max_bytes, queue, admission)"
            )
    base = _missing_base(concern, component)
    if base is not None:
        return (
            f"its {word} {name!r} (class {component.__module__}.{component.__qualname__}) does not "
            f"subclass {base}; every {word} must, for the defaults of the optional methods core "
            "calls (see docs/writing-plugins.md)"
        )
    return None


def _parse_filter(value: str | None) -> set[str] | None:
    if value is None:
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def _api_mismatch(dist: Distribution | None) -> str | None:
    """Why a plugin's distribution does not fit this kvplug, or ``None`` when it does.

    The plugin API follows semantic versions; a plugin states the range it was built
    for in its requirement on ``kvplug`` (``kvplug>=0.2,<0.3``).
    """
    for text in (dist.requires or []) if dist is not None else []:
        try:
            requirement = Requirement(text)
        except InvalidRequirement:
            continue
        if canonicalize_name(requirement.name) != PROJECT_NAME:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        if requirement.specifier and not requirement.specifier.contains(Version(KVPLUG_VERSION), prereleases=True):
            return f"it was built for kvplug{requirement.specifier} (plugin API), and this is kvplug {KVPLUG_VERSION}"
    return None


def _distribution_of(entry_point: EntryPoint) -> tuple[str, str]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "?", ""
    return dist.metadata["Name"], dist.version


@functools.lru_cache(maxsize=1)
def get_registry() -> PluginRegistry:
    """The process-wide registry, built on first use."""
    return PluginRegistry()
