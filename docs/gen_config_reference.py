"""Regenerate docs/config.md from the config models: python docs/gen_config_reference.py > docs/config.md"""

from __future__ import annotations

from typing import Annotated, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvplug import Bounded
from kvplug.core.config import KVPlugConfig, StoreSettings
from kvplug.core.tier import TierConfig
from kvplug_compress import FP8Serializer, ZstdSerializer
from kvplug_cpu import CPUTier
from kvplug_native import NativeConnector

HEADER = """# Config reference

Every setting of `KVPlugConfig`. Layers, later wins: defaults, YAML file
(`KVPLUG_CONFIG`), `KVPLUG_*` environment (`__` nests: `KVPLUG_STORE__MODE=sync`; lists
and mappings as JSON: `KVPLUG_TIERS='[{"type":"cpu"}]'`), the engine's extra config
(`kvplug.`-prefixed keys such as `kvplug.store.mode`, or a nested `kvplug` mapping;
`kvplug.config` names a YAML file), and per-request settings. Unknown keys are errors.
`kvplug config show` prints the effective values and their sources.

Sizes take `8GiB`, `512MB`, `1.5GB` or a byte count.
"""

SERIALIZERS = """
## Serializer

`serializer: {type: raw}` (core) stores each chunk's bytes behind a checksummed header.
kvplug-compress adds `zstd` and `lz4` (lossless, bit exact: byte planes compressed
apart) and `int8` and `fp8` (lossy, opt-in: one scale per group of `group_size`
elements, error bound in plugins/kvplug_compress/README.md).

The serializer is one per engine, not per tier: every tier stores the same frame, so a
key names one byte format, a hit promoted from a slow tier to a fast one is copied as
it is (no transcoding), and engines sharing a tier agree on what a key holds. With a
compressing serializer the cpu tier holds compressed frames too (int8/fp8: about twice
the chunks per budget; zstd/lz4: loads pay the decompression). The serializer's name
and its options that change the stored bytes are part of the key fingerprint, so
chunks are never read by another serializer or setting.
"""

CONNECTORS = """
## Connector

`connector: {type: auto}` (the default) picks the fastest connector installed that can
run here: `cuda` (kvplug-cuda, a CUDA device), then `native` (kvplug-native: a batch's
copies in one C call on the caller's OpenMP team, for caches in host memory), then
`torch` (core: any device). All of them read and write the same chunk bytes.
"""


def _default(value: object) -> object:
    if isinstance(value, StoreSettings):
        return "see store below"
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list):
        return [_default(v) for v in value]
    return value


def _bounds(field: FieldInfo) -> Bounded | None:
    """The :class:`kvplug.Bounded` range of a field, also inside ``ThreadCount | Literal["auto"]``."""
    candidates = list(field.metadata)
    for member in get_args(field.annotation):
        candidates += get_args(member)[1:] if get_origin(member) is Annotated else []
    return next((c for c in candidates if isinstance(c, Bounded)), None)


def table(title: str, model: type[BaseModel], prefix: str = "", skip: set[str] = frozenset()) -> str:
    lines = [f"\n## {title}\n", "| setting | default | meaning |", "|---|---|---|"]
    for name, field in model.model_fields.items():
        if name in skip:
            continue
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        note = " Per request." if extra.get("per_request") else ""
        default = _default(field.get_default(call_default_factory=True))
        bounds = _bounds(field)
        if bounds is not None:
            note = f" Allowed: {bounds.describe()}.{note}"
        lines.append(f"| `{prefix}{name}` | `{default}` | {field.description or ''}{note} |")
    return "\n".join(lines)


def render() -> str:
    parts = [
        HEADER,
        table("Top level", KVPlugConfig),
        table("`store`", StoreSettings, "store."),
        table("Options every tier takes (`kvplug.TierConfig`)", TierConfig),
        table("Tier `cpu` (kvplug-cpu)", CPUTier.Config, skip=set(TierConfig.model_fields) - {"max_bytes"}),
        SERIALIZERS,
        table(
            "Serializers `zstd` and `lz4` (kvplug-compress; lz4's `level`: 0 fast, 1-12 HC)",
            ZstdSerializer.Config,
            "serializer.",
        ),
        table("Serializers `int8` and `fp8` (kvplug-compress)", FP8Serializer.Config, "serializer."),
        CONNECTORS,
        table("Connector `native` (kvplug-native)", NativeConnector.Config, "connector."),
        "\nOther plugins document their options in their README; `kvplug config validate`\n"
        "lists the allowed keys of any installed component when one is misspelled.",
    ]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    print(render(), end="")
