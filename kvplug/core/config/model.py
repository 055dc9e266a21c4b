"""``KVPlugConfig``: the one validated config that assembles a cache engine.

Validation has two steps. ``KVPlugConfig.model_validate`` checks the structure;
:meth:`KVPlugConfig.resolve` then validates each ``{type: name, ...}`` entry with the
``Config`` model of the component that provides ``name`` in one plugin registry, and
returns a new config that carries the validated options and remembers that registry.
Nothing is ever written into an existing config: a resolved config is a new, frozen
object, and using it with another registry resolves it again.
:func:`kvplug.load_config` does both, after merging the layers, and reports structural
and component problems together (see :mod:`kvplug.core.config.loader`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    ByteSize,
    ConfigDict,
    Field,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    create_model,
    model_validator,
)

from kvplug.core.chunk_format import DEFAULT_MAX_CHUNK_BYTES
from kvplug.core.components import CheckedModel
from kvplug.core.concerns import CONFIG_CONCERNS
from kvplug.core.config.entries import (
    ComponentSpec,
    check_distinct_locations,
    component_slots,
    effective_component,
    resolve_components,
)
from kvplug.core.config.problems import problems_from_validation_error
from kvplug.core.config_types import ThreadCount, TimeoutSeconds
from kvplug.core.plugins import PluginRegistry, get_registry
from kvplug.core.queue_settings import QueueSettings, complete_queue
from kvplug.core.tenancy import PinSpec
from kvplug.core.tenants import TenancyConfig
from kvplug.errors import ConfigError, ConfigProblem

#: The most KV heads one record may hold (models have at most a few hundred).
MAX_HEADS_PER_RECORD = 4096


class StoreSettings(CheckedModel):
    """How ``CacheEngine.store`` hands chunks to the tiers."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _complete_queue(cls, data: Any) -> Any:
        return complete_queue(cls, data)

    queue: QueueSettings = Field(
        default_factory=lambda: QueueSettings(mode="async", max_items=64, on_full="block"),
        description="The store queue between store calls and the tiers: async, a worker thread writes the "
        "tiers; sync, the store call does. Its bytes count chunk data queued and being written.",
    )
    frame_pool_bytes: ByteSize | None = Field(
        default=None,
        description="Host memory recycled for chunk frames; None: the max_bytes of in-memory "
        "tiers plus 256MiB; 0: no pool (every frame is fresh memory).",
    )
    prefault_frames: bool = Field(
        default=True,
        description="Fault the frame pool's next 64 MiB of memory in on a background thread before stores "
        "need it (Linux 5.14+), so that a new engine's stores do not pay page faults (a copy into new "
        "pages runs several times slower than into resident ones). Commits at most one "
        "64 MiB segment ahead of what frames use; off: pages are faulted in by the stores themselves.",
    )


class KVPlugConfig(CheckedModel):
    """The whole kvplug config. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    chunk_size: PositiveInt = Field(default=256, le=1 << 20, description="Tokens per chunk.")
    hash: Literal["sha256", "xxh3_128", "blake3"] = Field(default="sha256", description="Hash of the chunk key chain.")
    save_unfull_chunk: bool = Field(
        default=False,
        description="Also store the last, partial chunk of a prompt.",
        json_schema_extra={"per_request": True},
    )
    block_granular_hits: bool = Field(
        default=False,
        description="Hits granular to the engine's KV block, as its own prefix cache, not to whole chunks: "
        "a store also keeps the prompt's tokens past its last whole chunk, cut at its last whole block (one "
        "record), and a lookup that stops inside a chunk finds the longest such record.",
    )
    skip_save: bool = Field(
        default=False, description="Store nothing (lookups still hit).", json_schema_extra={"per_request": True}
    )
    pin: list[PinSpec] = Field(
        default_factory=list,
        description="Prefixes whose chunks no tier evicts (within each tier's pin_max_bytes): "
        "[{salt: tenant-a, prefix_file: system_prompt.json}]; applied at start to chunks held and to the "
        "others when stored, in this process (docs/operations.md).",
    )
    pin_request: bool = Field(
        default=False,
        description="Pin the chunks this request stores (engine adapters map their request flag to it, "
        "e.g. kvplug.pin: true; docs/operations.md). Ignored (counted, logged) unless tenancy.request_pins.",
        json_schema_extra={"per_request": True},
    )
    tenancy: TenancyConfig = Field(
        default_factory=TenancyConfig,
        description="Who may pin, the pin book's bound, and tenant names for metrics (docs/security.md).",
    )
    serializer: ComponentSpec = Field(
        default_factory=lambda: ComponentSpec(type="raw"), description="Serializer of chunk frames."
    )
    max_chunk_bytes: ByteSize = Field(
        default=ByteSize(DEFAULT_MAX_CHUNK_BYTES),
        gt=0,
        le=1 << 40,
        description="Largest chunk, in bytes of its decoded tensor, that a load decodes: every size a "
        "frame's header declares (shape, segments, a codec's output size) is checked against it before "
        "anything is allocated, so a forged frame cannot make a reader allocate more. Must hold one "
        "chunk of the model (chunk_size tokens of every layer's K and V); the engine says so if not.",
    )
    connector: ComponentSpec = Field(
        default_factory=lambda: ComponentSpec(type="auto"),
        description="KV connector; 'auto' picks the fastest available one.",
    )
    tiers: list[ComponentSpec] = Field(
        default_factory=lambda: [ComponentSpec(type="cpu")],
        min_length=1,
        description="Storage tiers, fastest first.",
    )
    store: StoreSettings = Field(default_factory=StoreSettings, description="How stores reach the tiers.")
    copy_threads: ThreadCount | Literal["auto"] = Field(
        default="auto",
        description="Threads that copy KV between the engine's host KV cache and chunk frames, for stores "
        "and loads (the caller waits); auto: torch's intra-op threads, at most 4. Copies on a GPU ignore it. "
        "The native connector (kvplug-native) copies a call on that many threads of the calling thread's "
        "OpenMP team (torch's own) when called from the main thread, else on copy threads; the torch "
        "connector always on copy threads. With the torch connector, where the engine's own threads take "
        "every core (an engine running on the CPU), fewer may be faster: measure on your hosts "
        "(benchmarks/README.md).",
    )
    heads_per_record: Annotated[int, Field(ge=1, le=MAX_HEADS_PER_RECORD)] | Literal["auto"] = Field(
        default="auto",
        description="KV heads per stored record. A chunk is stored as one record per group of this many "
        "heads, keyed by the group's head range, never by the TP rank or size. auto: the heads of one rank "
        "(one record per chunk per rank). Engines of every TP size read any split: where a rank's own "
        "records of a prompt's first chunk miss, it joins smaller records of its heads or slices a larger "
        "one. A smaller group costs more, smaller records; an int must divide every rank's heads. Latent "
        "(MLA) and replicated heads are one record for all ranks whatever this says.",
    )
    tp_sharing: Literal["any", "same"] = Field(
        default="any",
        description="Which tensor-parallel sizes read a writer's records. any: every TP size (a load is bit for "
        "bit the writer's KV; an engine of another TP size computes other KV in the last bits, since its "
        "row-parallel layers all-reduce other partial sums in bf16, so its output may differ from its own run). "
        "same: only engines of the writer's TP size hit: a hit is then bit for bit the KV this engine would "
        "have computed (LMCache's default: it keys chunks by world size).",
    )
    lookup_budget_s: TimeoutSeconds = Field(
        default=0.2,
        description="Seconds one lookup may take across all tiers; remote calls end within it and tiers not "
        "asked in time count as a miss.",
    )

    #: The registry this config was resolved against; None: not resolved.
    _registry: PluginRegistry | None = PrivateAttr(default=None)

    @classmethod
    def per_request_fields(cls) -> set[str]:
        return {
            name
            for name, info in cls.model_fields.items()
            if isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("per_request")
        }

    @property
    def resolved(self) -> bool:
        """Whether the component options are validated (this is what :meth:`resolve` returned)."""
        return self._registry is not None

    @property
    def registry(self) -> PluginRegistry | None:
        """The plugin registry this config was resolved against (its components' classes);
        ``None`` when it is not resolved."""
        return self._registry

    def resolve(self, registry: PluginRegistry | None = None) -> KVPlugConfig:
        """A new config whose component entries are validated by their components' ``Config``.

        Returns ``self`` when it is already resolved against ``registry``; a config
        resolved against another registry is resolved again, from its raw options.
        Raises :class:`~kvplug.errors.ConfigError` listing every problem found.
        """
        registry = registry or get_registry()
        if self._registry is registry:
            return self
        problems: list[ConfigProblem] = []
        specs = self._component_specs()
        options = resolve_components(
            [
                (path, concern, spec.type, spec.raw_options)
                for (path, concern), spec in zip(component_slots(len(self.tiers)), specs)
            ],
            registry,
            problems,
        )
        resolved = self._assemble([spec._with_options(opts) for spec, opts in zip(specs, options)], registry)
        check_distinct_locations(resolved.tiers, problems)
        if not problems:
            _check_memory_budgets(self, resolved.tiers, registry, problems)
        if problems:
            raise ConfigError(problems)
        return resolved

    def _component_specs(self) -> list[ComponentSpec]:
        """Every component entry, in :func:`component_slots` order."""
        specs: list[ComponentSpec] = []
        for concern in CONFIG_CONCERNS:
            value = getattr(self, str(concern.config_field))
            specs.extend(value if concern.many else [value])
        return specs

    def _assemble(self, specs: list[ComponentSpec], registry: PluginRegistry) -> KVPlugConfig:
        """A copy of this config with ``specs`` (in :func:`component_slots` order) resolved against ``registry``."""
        update: dict[str, Any] = {}
        rest = list(specs)
        for concern in CONFIG_CONCERNS:
            name = str(concern.config_field)
            count = len(getattr(self, name)) if concern.many else 1
            taken, rest = rest[:count], rest[count:]
            update[name] = taken if concern.many else taken[0]
        copy = self.model_copy(update=update)
        copy._registry = registry
        return copy

    def effective(self) -> dict[str, Any]:
        """The config as plain data, with every component's options validated and defaulted."""
        data = self.model_dump(mode="json")
        for concern in CONFIG_CONCERNS:
            name = str(concern.config_field)
            value = getattr(self, name)
            data[name] = [effective_component(s) for s in value] if concern.many else effective_component(value)
        return data

    def with_overrides(self, overrides: Mapping[str, Any], *, source: str = "request") -> KVPlugConfig:
        """A copy with per-request settings changed; other keys are errors.

        Only the overridden settings are validated (by :func:`_overrides_model`, with the
        same field rules); the rest of the config is this one's, resolved components included.
        """
        allowed = self.per_request_fields()
        problems = [
            ConfigProblem(key, value, f"cannot be set per request; per-request settings: {', '.join(sorted(allowed))}")
            for key, value in overrides.items()
            if key not in allowed
        ]
        if problems:
            raise ConfigError(problems, source)
        if not overrides:
            return self
        data = dict(overrides)
        try:
            checked = _overrides_model(type(self)).model_validate(data)
        except ValidationError as exc:
            raise ConfigError(problems_from_validation_error(exc, data), source) from None
        return self.model_copy(update={key: getattr(checked, key) for key in data})


@functools.cache
def _overrides_model(config_class: type[KVPlugConfig]) -> type[CheckedModel]:
    """A model of ``config_class``'s per-request settings alone, with their own fields: a
    request's settings are validated without dumping and validating the whole config."""
    fields: dict[str, Any] = {
        name: (info.annotation, info)
        for name, info in config_class.model_fields.items()
        if name in config_class.per_request_fields()
    }
    return create_model(f"{config_class.__name__}Overrides", __base__=CheckedModel, **fields)


def physical_memory() -> tuple[int, str]:
    """Bytes of memory this process can have, and what limits it: the machine's RAM, or a
    smaller cgroup limit (a container)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    what = "physical memory"
    for limit_file in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit_file).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total, what = int(text), f"the cgroup memory limit ({limit_file})"
        break
    return total, what


def _check_memory_budgets(
    config: KVPlugConfig, tiers: list[ComponentSpec], registry: PluginRegistry, problems: list[ConfigProblem]
) -> None:
    """In-memory tiers' budgets plus the store queue must fit in memory: past it, the
    engine is killed (ENOMEM, the OOM killer) long after the config was accepted."""
    classes = registry.components("storage_tier")
    held: list[tuple[str, int]] = []
    for index, spec in enumerate(tiers):
        component = classes.get(spec.type)
        budget = getattr(spec._options, "max_bytes", None)
        if component is not None and getattr(component, "keeps_buffers", False) and budget:
            held.append((f"tiers[{index}].max_bytes", int(budget)))
    queue = int(config.store.queue.max_bytes) if config.store.queue.mode == "async" else 0
    wanted = sum(budget for _, budget in held) + queue
    available, what = physical_memory()
    if held and wanted > available:
        path, budget = held[-1]
        problems.append(
            ConfigProblem(
                path,
                budget,
                f"in-memory tiers' max_bytes ({' + '.join(_gib(b) for _, b in held)}) plus store.queue.max_bytes "
                f"({_gib(queue)}) need {_gib(wanted)}, more than {what} of this machine: {_gib(available)}; "
                "lower max_bytes",
            )
        )


def _gib(nbytes: int) -> str:
    return f"{nbytes / 1024**3:.2f} GiB"
