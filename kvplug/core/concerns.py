"""The plugin concerns in one table: what the registry, config resolution and errors know.

Each :class:`Concern` says which hook provides its components, the base class they
subclass, how a config names them and how errors speak of them, and which separately
installed package ships each of kvplug's own components (the install hint of a config
naming a component that is not installed, like fsspec's ``known_implementations``).
A test reads every plugin under ``plugins/`` and fails when one ships a component this
table does not know, so the hints cannot go stale.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Concern:
    """One plugin concern (serializer, storage tier, KV connector, engine adapter)."""

    #: The registry's key: ``registry.components(key)``.
    key: str
    #: The hook returning the concern's component classes.
    hook: str
    #: ``(module, class)`` of the base class every component subclasses.
    base: tuple[str, str]
    #: How a config error names a component's kind: ``unknown tier type 'x'``.
    word: str
    #: How a plugin error names it: ``its storage tier 'x' does not subclass ...``.
    label: str
    #: The ``KVPlugConfig`` field whose ``{type: ...}`` entries choose components; ``None``:
    #: not chosen by the config (engine adapters: the engine picks its own).
    config_field: str | None = None
    #: Whether that field is a list of entries (``tiers``) rather than one entry.
    many: bool = False
    #: Names the config accepts besides installed components (``connector: {type: auto}``).
    pseudo: tuple[str, ...] = ()
    #: kvplug's own components shipped in separate packages: name -> distribution to install
    #: (every concern a config chooses lists all of them; a test holds it to ``plugins/``).
    known: Mapping[str, str] = field(default_factory=dict)

    def install_hint(self, name: str) -> str | None:
        """The package that provides component ``name``, or ``None`` when kvplug ships none."""
        return self.known.get(name)


def install_command(package: str) -> str:
    """How to install one of kvplug's own packages, for an error message (never wrapped).

    The packages are not on PyPI yet: the index name comes first, for when they are, then
    the two ways that work today (a checkout, or the wheels ``nox -s build`` writes).
    """
    folder = "plugins/" + package.replace("-", "_")
    return (
        f"pip install {package} (not yet published: pip install -e {folder} from a kvplug checkout, "
        f"or pip install --find-links dist {package} after nox -s build)"
    )


def _known(**packages: str) -> Mapping[str, str]:
    return MappingProxyType(packages)


#: Every concern, in the order ``kvplug plugins`` shows them in.
CONCERNS: tuple[Concern, ...] = (
    Concern(
        "serializer",
        "kvplug_serializers",
        ("kvplug.core.serializer", "Serializer"),
        "serializer",
        "serializer",
        config_field="serializer",
        known=_known(zstd="kvplug-compress", lz4="kvplug-compress", int8="kvplug-compress", fp8="kvplug-compress"),
    ),
    Concern(
        "storage_tier",
        "kvplug_storage_tiers",
        ("kvplug.core.tier", "StorageTier"),
        "tier",
        "storage tier",
        config_field="tiers",
        many=True,
        known=_known(
            cpu="kvplug-cpu",
            disk="kvplug-disk",
            shm="kvplug-disk",
            s3="kvplug-s3",
            valkey="kvplug-valkey",
            mooncake="kvplug-mooncake",
        ),
    ),
    Concern(
        "kv_connector",
        "kvplug_kv_connectors",
        ("kvplug.core.connector", "KVConnector"),
        "connector",
        "KV connector",
        config_field="connector",
        pseudo=("auto",),
        known=_known(cuda="kvplug-cuda", native="kvplug-native"),
    ),
    Concern(
        "engine_adapter",
        "kvplug_engine_adapters",
        ("kvplug.core.components", "EngineAdapter"),
        "engine adapter",
        "engine adapter",
        # No install hints: a config never names an adapter (the engine loads its own), and
        # the core names no engine (tests/test_no_engine_names.py).
    ),
)

#: concern key -> :class:`Concern`.
CONCERNS_BY_KEY: Mapping[str, Concern] = MappingProxyType({concern.key: concern for concern in CONCERNS})

#: The concerns a config chooses, in the order of ``KVPlugConfig``'s fields:
#: ``serializer``, ``connector``, ``tiers``.
CONFIG_CONCERNS: tuple[Concern, ...] = tuple(
    CONCERNS_BY_KEY[key] for key in ("serializer", "kv_connector", "storage_tier")
)

#: The tier of kvplug's own that opens a kind of ``kvplug store`` location, by URL scheme
#: (``""``: a folder), for the hint when no installed tier does; any other scheme: ``s3``
#: (any fsspec URL). Like the components' ``known``: what is not installed cannot say it.
LOCATION_TIERS: Mapping[str, str] = MappingProxyType(
    {"": "disk", "file": "disk", **dict.fromkeys(("redis", "rediss", "valkey", "valkeys", "unix"), "valkey")}
)


def location_package(location: str) -> str:
    """The package whose tier opens ``location`` (a folder, ``s3://...``, ``redis://...``)."""
    scheme = location.split("://", 1)[0].lower() if "://" in location else ""
    tier = LOCATION_TIERS.get(scheme, "s3")
    return CONCERNS_BY_KEY["storage_tier"].known[tier]
