"""Config field descriptions say what a setting does; measured figures go stale there (and in
the generated docs/config.md) and belong in benchmarks/README.md."""

from __future__ import annotations

import re
from collections.abc import Iterator

from pydantic import BaseModel

from kvplug import get_registry
from kvplug.core.concerns import CONCERNS
from kvplug.core.config.model import KVPlugConfig

#: A figure with a unit of speed or time, or the words a measurement report uses.
MEASURED = re.compile(
    r"\d\s*(GB/s|MB/s|GiB/s|MiB/s|ms\b|µs|us\b)|\d\s*x (faster|slower)|\bmedians?\b|\b\d+-core\b|\bVM\b", re.I
)


def _descriptions(model: type[BaseModel], path: str, seen: set[type]) -> Iterator[tuple[str, str]]:
    if model in seen:
        return
    seen.add(model)
    for name, field in model.model_fields.items():
        if field.description:
            yield f"{path}{name}", field.description
        for arg in (field.annotation, *getattr(field.annotation, "__args__", ())):
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                yield from _descriptions(arg, f"{path}{name}.", seen)


def test_no_config_description_carries_a_measured_figure() -> None:
    registry = get_registry()
    models: list[tuple[str, type[BaseModel]]] = [("", KVPlugConfig)]
    for concern in CONCERNS:
        for name, component in registry.components(concern.key).items():
            config = getattr(component, "Config", None)
            if isinstance(config, type) and issubclass(config, BaseModel):
                models.append((f"{concern.key} {name}: ", config))
    seen: set[type] = set()
    found = [
        f"{where}: {text}"
        for prefix, model in models
        for where, text in _descriptions(model, prefix, seen)
        if MEASURED.search(text)
    ]
    assert len(models) > 5  # the installed plugins' components were walked too
    assert found == []
