"""The component entries of a config (``{type: <name>, ...options}``) and their validation.

Each entry names a component (serializer, connector, storage tier) of one plugin registry;
its options are checked by that component's ``Config`` model when the config is resolved
(:meth:`kvplug.core.config.model.KVPlugConfig.resolve`), and by the loader together with the
structural problems (:mod:`kvplug.core.config.loader`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from kvplug.core.concerns import CONCERNS_BY_KEY, CONFIG_CONCERNS, install_command
from kvplug.core.config.problems import problems_from_validation_error
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigProblem


class ComponentSpec(BaseModel):
    """``{type: <name>, ...options}``; options are checked by that component's Config."""

    model_config = ConfigDict(extra="allow", frozen=True)

    type: str = Field(min_length=1)
    _options: BaseModel | None = PrivateAttr(default=None)

    def __repr_args__(self) -> Any:
        from kvplug.redaction import redact

        for name, value in super().__repr_args__():
            yield name, redact(value, name)

    @property
    def raw_options(self) -> dict[str, Any]:
        return dict(self.__pydantic_extra__ or {})

    @property
    def options(self) -> BaseModel:
        """The validated options; only on the config :meth:`KVPlugConfig.resolve` returns."""
        if self._options is None:
            raise RuntimeError(
                f"component {self.type!r} is not resolved; use the config KVPlugConfig.resolve() returns"
            )
        return self._options

    def _with_options(self, options: BaseModel | None) -> ComponentSpec:
        """A new spec carrying validated ``options`` (this one stays as it is)."""
        spec = self.model_copy()
        spec._options = options
        return spec


def component_slots(num_tiers: int) -> list[tuple[str, str]]:
    """``(path, concern)`` of every component entry of a config with ``num_tiers`` tiers,
    in the order of :data:`~kvplug.core.concerns.CONFIG_CONCERNS`: ``serializer``,
    ``connector``, ``tiers[i]``."""
    slots: list[tuple[str, str]] = []
    for concern in CONFIG_CONCERNS:
        name = str(concern.config_field)
        paths = [f"{name}[{i}]" for i in range(num_tiers)] if concern.many else [name]
        slots.extend((path, concern.key) for path in paths)
    return slots


def resolve_components(
    entries: list[tuple[str, str, str, dict[str, Any]]], registry: PluginRegistry, problems: list[ConfigProblem]
) -> list[BaseModel | None]:
    """Validate ``(path, concern, type, raw options)`` entries (see :func:`component_slots`)
    with the ``Config`` of the component ``type`` names in ``registry``.

    Appends a problem per unknown type or bad option to ``problems``; returns the
    validated options, ``None`` where validation failed.
    """
    results: list[BaseModel | None] = []
    for path, concern, name, raw in entries:
        if name in CONCERNS_BY_KEY[concern].pseudo:  # connector: auto, the only one
            results.append(_validate_options(raw, _AutoConnectorOptions, path, problems))
            continue
        available = registry.components(concern)
        component = available.get(name)
        if component is None:
            problems.append(
                ConfigProblem(f"{path}.type", name, _unknown_type_message(concern, name, available, registry))
            )
            results.append(None)
            continue
        results.append(_validate_options(raw, component.Config, path, problems))
    return results


def check_distinct_locations(tiers: list[ComponentSpec], problems: list[ConfigProblem]) -> None:
    """Two tiers on one folder or bucket prefix would evict and count each other's records."""
    seen: dict[str, int] = {}
    for index, spec in enumerate(tiers):
        locate = getattr(spec._options, "location", None)
        where = locate() if callable(locate) else None
        if not isinstance(where, str):
            continue
        if where in seen:
            first = seen[where]
            problems.append(
                ConfigProblem(
                    f"tiers[{index}]",
                    where,
                    f"tier {spec.type!r} uses the same location as tiers[{first}] ({tiers[first].type!r}): {where}; "
                    "give each tier its own folder or prefix",
                )
            )
        else:
            seen[where] = index


def effective_component(spec: ComponentSpec) -> dict[str, Any]:
    options = spec.raw_options if spec._options is None else spec._options.model_dump(mode="json")
    return {"type": spec.type, **options}


class _AutoConnectorOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _validate_options(
    options: dict[str, Any], model: type[BaseModel], path: str, problems: list[ConfigProblem]
) -> BaseModel | None:
    try:
        return model.model_validate(options, context={"path": path})
    except ValidationError as exc:
        problems.extend(problems_from_validation_error(exc, options, prefix=path, model=model))
        return None


def _unknown_type_message(concern: str, name: str, available: Mapping[str, type], registry: PluginRegistry) -> str:
    kind = CONCERNS_BY_KEY[concern]
    package = kind.install_hint(name)
    if package:
        message = f"{kind.word} type {name!r} needs the {package} package: {install_command(package)}"
    else:
        installed = ", ".join([*sorted(available), *kind.pseudo]) or "none"
        message = f"unknown {kind.word} type {name!r}; installed: {installed}"
    if registry.load_errors:
        message += "; plugins that failed to load: " + ", ".join(e.plugin for e in registry.load_errors)
    return message
