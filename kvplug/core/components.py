"""Base classes of the four plugin concerns that need no torch.

Torch-facing bases (:class:`kvplug.Serializer`, :class:`kvplug.KVConnector`) live
in :mod:`kvplug.core.serializer` and :mod:`kvplug.core.connector`, so that a storage
plugin can import everything it needs from here without importing torch.
"""

from __future__ import annotations

import os
import re
import types
from pathlib import PurePath
from typing import Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from kvplug.core.config_types import parse_byte_size

#: Largest integer any setting may hold: it must fit a signed 64-bit field.
MAX_INT_SETTING = 2**63 - 1
_WHOLE_NUMBER = re.compile(r"\s*[+-]?\d+\s*")


class CheckedModel(BaseModel):
    """A settings model that refuses values pydantic's lax mode would quietly convert.

    For every field: an integer field takes no bool (``true`` is not 1) and no float
    (``1e32``, ``8.0``), only an int, or a string of digits (environment variables), and
    nothing outside a signed 64-bit range; a ``ByteSize`` field takes what
    :func:`~kvplug.core.config_types.parse_byte_size` takes (``8GiB``, 0 to 4 EiB);
    a text or path value holds no NUL; a path is not empty (``""`` would mean the current
    folder); ``max_bytes`` is greater than 0.
    """

    # A model's validator is built when it first validates: ``kvplug config validate`` imports
    # every installed component's Config (to resolve names) and validates only those the file uses.
    model_config = ConfigDict(defer_build=True)

    def __repr_args__(self) -> Any:
        # Configs get logged and printed in tracebacks: never with a credential in them.
        from kvplug.redaction import redact

        for name, value in super().__repr_args__():
            yield name, redact(value, name)

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_lax_values(cls, value: Any, info: ValidationInfo) -> Any:
        if info.field_name is None:
            return value
        field = cls.model_fields.get(info.field_name)
        annotation = field.annotation if field is not None else None
        if isinstance(value, (str, PurePath)) and "\0" in str(value):
            raise ValueError("must not contain a NUL character (\\0)")
        if (
            _accepts(annotation, PurePath)
            and not _accepts(annotation, str)
            and isinstance(value, str)
            and not value.strip()
        ):
            raise ValueError("must not be empty (an empty path would mean the current folder); give a folder")
        if _accepts_byte_size(annotation):
            if value is not None:
                value = parse_byte_size(value)
        elif _accepts(annotation, int) and not _accepts(annotation, (str, float)):
            _check_integer(value)
        if info.field_name == "max_bytes" and isinstance(value, int) and value <= 0:
            raise ValueError("must be greater than 0 (a budget of 0 stores nothing)")
        return value


def _check_integer(value: Any) -> None:
    if isinstance(value, bool):
        raise ValueError(f"must be an integer, not a boolean ({str(value).lower()})")
    if isinstance(value, float):
        raise ValueError(f"must be an integer, not a float ({value!r})")
    if isinstance(value, int) and not -MAX_INT_SETTING <= value <= MAX_INT_SETTING:
        raise ValueError(f"must be less than or equal to {MAX_INT_SETTING} in size")
    if isinstance(value, str) and not _WHOLE_NUMBER.fullmatch(value):
        raise ValueError("must be a whole number, e.g. 256, not other text")


def _members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(a for a in get_args(annotation) if a is not type(None))
    return (annotation,)


def _accepts(annotation: Any, kinds: type | tuple[type, ...]) -> bool:
    """Whether a field of ``annotation`` holds a value of one of ``kinds`` (bool is not an int)."""
    for member in _members(annotation):
        if isinstance(member, type) and issubclass(member, kinds) and member is not bool:
            return True
    return False


def _accepts_byte_size(annotation: Any) -> bool:
    from pydantic import ByteSize

    return _accepts(annotation, ByteSize)


class ComponentConfig(CheckedModel):
    """Base of every component's ``Config``: unknown keys are errors.

    A component that stores data somewhere says where through :meth:`location`, so
    that a config naming one location twice is refused.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def location(self) -> str | None:
        """Where this component keeps its data, normalised, or ``None`` (memory, nothing).

        The default reads a ``path`` field (a folder, made absolute and normalised) or
        a ``url`` field (trailing slashes dropped, with ``endpoint_url`` when set).
        Override it when a component's location is spelled otherwise.
        """
        path = getattr(self, "path", None)
        if isinstance(path, (str, PurePath)) and str(path):
            return os.path.normpath(os.path.abspath(os.path.expanduser(str(path))))
        url = getattr(self, "url", None)
        if isinstance(url, str) and url:
            endpoint = getattr(self, "endpoint_url", None)
            where = url.rstrip("/")
            return f"{where} at {endpoint.rstrip('/')}" if isinstance(endpoint, str) and endpoint else where
        return None


class EmptyConfig(ComponentConfig):
    """The ``Config`` of a component that takes no options."""


class EngineAdapter:
    """Describes one serving engine's integration (an engine adapter plugin).

    The integration itself is registered with the engine by the engine's own
    plugin system; this class lets ``kvplug plugins`` list it and lets
    ``kvplug demo`` run the real engine.
    """

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = EmptyConfig
    #: Distribution name of the engine package, for version reports.
    engine_distribution: ClassVar[str] = ""
    #: ``KVPLUG_*`` environment variables the adapter sets for its engine's processes
    #: (not config settings): the config loader does not report them as unknown.
    environment: ClassVar[tuple[str, ...]] = ()

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
