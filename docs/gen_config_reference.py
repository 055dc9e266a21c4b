"""Regenerate docs/config.md from the config models: python docs/gen_config_reference.py > docs/config.md"""

from __future__ import annotations

from typing import Annotated, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from kvplug import Bounded, QueueSettings
from kvplug.core.config.model import KVPlugConfig, StoreSettings
from kvplug.core.policies.admission import FrequencyAdmissionConfig
from kvplug.core.tenants import TenancyConfig
from kvplug.core.tier import TierConfig
from kvplug_compress import FP8Serializer, ZstdSerializer
from kvplug_cpu import CPUTier
from kvplug_native import NativeConnector

HEADER = """# Config reference

Every setting of `KVPlugConfig`. Layers, later wins: defaults, YAML file
(`KVPLUG_CONFIG`), `KVPLUG_*` environment (`__` nests: `KVPLUG_STORE__QUEUE__MODE=sync`; lists
and mappings as JSON: `KVPLUG_TIERS='[{"type":"cpu"}]'`; a number picks a list item, of this
layer's list or the file's: `KVPLUG_TIERS__0__MAX_BYTES=8GiB`), the engine's extra config
(`kvplug.`-prefixed keys such as `kvplug.store.queue.mode`, or a nested `kvplug` mapping;
`kvplug.config` names a YAML file), and per-request settings. Unknown keys are errors.
`kvplug config show` prints the effective values and their sources.

Every environment variable named `KVPLUG_*` applies or is an error that names it (an unknown
setting, a part of a single value, an item the list does not have, JSON that does not parse).
An invalid value's error also names the layer that set it (`chunk_size: must be a whole number,
e.g. 256, not other text; set in env KVPLUG_CHUNK_SIZE`), so a forgotten variable or engine key,
alone or overriding a correct file, is found at once; a value from the config file also names its
line (`set in file kvplug.yaml, line 9`, or `; line 9` when the file set everything). The engine's
config alone is not named: it is the one the engine was given.

Within one layer a setting is given once: two variables for it (`KVPLUG_CHUNK_SIZE` and
`kvplug_chunk_size`, `KVPLUG_TIERS__0__…` and `KVPLUG_TIERS__00__…`) or two engine keys are an
error naming both. A whole value applies before its parts (`kvplug.store`, then
`kvplug.store.queue.mode`). A component's options alone (`KVPLUG_SERIALIZER__THREADS=2`) apply to
the type an earlier layer chose; a layer that names a `type` replaces the component whole. A
config file is UTF-8 YAML of at most 1 MiB, nested at most 64 levels, each key once, without
aliases or merge keys (`<<`).

Sizes take `8GiB`, `512MB`, `1.5GB` or a byte count, from 0 to 4 EiB: one rule for every size
setting, plugins' included (`kvplug.core.config_types.parse_byte_size`); a negative size, a
float or a boolean is refused by name.
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

QUEUES = """
One model, `kvplug.QueueSettings`, configures every write-behind queue: the store queue
(`store.queue`, between store calls and the tiers) and each tier's write queue
(`tiers[i].queue`, kept by the tier chain). An async tier's queued values are readable at
once, a second write of a queued key replaces it, a removal cancels it, and `on_close`
says whether close writes or drops what is queued. Defaults differ by owner; a partial
`queue:` mapping changes only the keys it names:

| owner | `mode` | `max_items` | `on_full` |
|---|---|---|---|
| `store.queue` | async | 64 | block |
| tier `cpu` (and any tier by default) | sync | 1024 | drop |
| tiers `disk`, `shm` | async | 64 | drop |
| remote tiers (`s3`, `valkey`, `mooncake`) | async | 1024 | drop |

Queue settings go under `queue:` only: a queue key beside it (`store.mode`, a tier's
`write_mode`, the disk tier's `writer`, ...: keys of unreleased development versions) is an
unknown key, a config error naming it."""

ADMISSION = """
`tiers[i].admission` decides which chunks the tier chain writes to that tier: `{type: all}`
(the default) writes every chunk; `{type: frequency, min_hits: 2}` writes a chunk once its
key was seen `min_hits` times, so one-off prompts never reach the tier. A sighting is a
store of the chunk or a verified load of it; lookups do not count (an engine repeats them
while a request waits). The counts live in a count-min sketch of fixed size (`sketch_keys`:
counts halve every 10 x `sketch_keys` sightings; 4 MiB for the default 100000). A chunk declined when stored and
later loaded from a faster tier is written to this tier on the load that admits it;
promotions into a faster tier respect its admission too. Counted per tier in
`kvplug_admission_admitted_total` and `kvplug_admission_declined_total`.
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
    if isinstance(value, TenancyConfig):
        return "see tenancy below"
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
        table("`tenancy` (who may pin; tenant names)", TenancyConfig, "tenancy."),
        table("Write queues: `store.queue` and `tiers[i].queue` (`kvplug.QueueSettings`)", QueueSettings, "queue."),
        QUEUES,
        table("Options every tier takes (`kvplug.TierConfig`)", TierConfig),
        table(
            "Tier admission `{type: frequency}` (`kvplug.core.policies.admission.FrequencyAdmissionConfig`)",
            FrequencyAdmissionConfig,
            "admission.",
        ),
        ADMISSION,
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
