"""Config errors from pydantic's: one :class:`~kvplug.errors.ConfigProblem` per error, with
the field's path (``tiers[0].max_bytes``) and, for an unknown key, the keys allowed there.

Apart from the loader so that the config model and the loader both use it without
importing each other."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from kvplug.errors import ConfigProblem


def problems_from_validation_error(
    exc: ValidationError,
    data: Any,
    *,
    prefix: str = "",
    model: type[BaseModel] | None = None,
) -> list[ConfigProblem]:
    """One :class:`ConfigProblem` per pydantic error, with a ``tiers[0].max_bytes`` path."""
    problems = []
    for error in exc.errors(include_url=False):
        loc = tuple(part for part in error["loc"] if not (isinstance(part, str) and part.startswith("function-")))
        loc = _without_union_tags(loc, data)
        path = _format_path(prefix, loc)
        message = error["msg"]
        if error["type"] == "extra_forbidden" and model is not None:
            allowed = _allowed_keys(model, loc[:-1])
            if allowed:
                message = f"unknown key; {did_you_mean(str(loc[-1]), allowed)}allowed: {', '.join(allowed)}"
        problems.append(ConfigProblem(path, error.get("input"), message))
    return problems


#: Settings renamed before the first release: old key -> (new key, what else changed). No
#: released version read the old names, so they are errors, whose message names the new key.
RENAMED = {
    "lookup_timeout_ms": ("lookup_budget_s", "in seconds, e.g. 0.2 for 200 ms"),
}


def renamed_to(name: str) -> str:
    """``renamed to 'lookup_budget_s' (in seconds ...); `` for an old ``name`` in :data:`RENAMED`
    (any case, an ``KVPLUG_`` variable name too), else ``""``."""
    key = name.lower().removeprefix("kvplug_")
    if key not in RENAMED:
        return ""
    new, note = RENAMED[key]
    shown = "KVPLUG_" + new.upper() if name.upper() == name and name.startswith("KVPLUG_") else new
    return f"renamed to {shown!r}" + (f" ({note})" if note else "") + "; "


def did_you_mean(name: str, allowed: list[str]) -> str:
    """The hint of an unknown-key error, as the config errors give it: ``did you mean
    'max_bytes'? `` when one of ``allowed`` is close to a misspelled ``name`` (difflib's
    ratio of at least 0.7, ignoring case), ``renamed to 'lookup_budget_s' (...); `` for a
    core setting renamed before the first release, else ``""``. It ends with a space, to
    go before the ``allowed: ...`` list."""
    if renamed_to(name):
        return renamed_to(name)
    close = difflib.get_close_matches(name.lower(), [a.lower() for a in allowed], n=1, cutoff=0.7)
    if not close:
        return ""
    return f"did you mean {next(a for a in allowed if a.lower() == close[0])!r}? "


def _without_union_tags(loc: tuple[Any, ...], data: Any) -> tuple[Any, ...]:
    """``loc`` without the tags pydantic puts in the path of a union chosen by ``type``
    (``admission.frequency.min_hits`` is the user's ``admission.min_hits``): a part that
    is no key of the input there but the value of its ``type`` key."""
    kept: list[Any] = []
    for part in loc:
        if isinstance(data, Mapping) and isinstance(part, str) and part not in data and data.get("type") == part:
            continue
        kept.append(part)
        if isinstance(data, Mapping):
            data = data.get(part)
        elif isinstance(part, int) and isinstance(data, (list, tuple)) and 0 <= part < len(data):
            data = data[part]
        else:
            data = None
    return tuple(kept)


def _format_path(prefix: str, loc: tuple[Any, ...]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def _allowed_keys(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    current: Any = model
    for part in loc:
        if isinstance(part, int):
            continue
        field_info = getattr(current, "model_fields", {}).get(part)
        if field_info is None:
            return []
        annotation = field_info.annotation
        args = getattr(annotation, "__args__", ())
        candidates = [annotation, *args]
        current = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if current is None:
            return []
    return sorted(getattr(current, "model_fields", {}))
