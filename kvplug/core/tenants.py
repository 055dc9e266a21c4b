"""Who may pin and how tenants are named: the engine-wide ``tenancy:`` settings.

A tenant is a ``cache_salt``, and a salt is the tenant's isolation secret: whoever knows
it shares the tenant's chunks. So a salt never becomes a metrics label or a stats key.
The operator names tenants (``tenancy.tenants: {name: salt}``) and figures carry the
name; a salt without a name that a tier's ``quotas`` counts apart is labelled by a
keyed digest (:class:`TenantLabels`), every other salt shares one label.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Container, Mapping

from pydantic import ConfigDict, Field, SecretStr, field_validator

from kvplug.core.components import CheckedModel

#: The metrics label of salted tenants that have no name and no quota of their own (a bounded label set).
OTHER_TENANTS = "(other)"
#: The metrics label of unsalted requests' chunks.
UNSALTED = "(unsalted)"
#: The quota that applies to every salt not named in ``quotas``.
DEFAULT_QUOTA = "default"
#: What the label of an unnamed salt starts with (a digest follows).
DIGEST_LABEL = "salt-"
#: ``stats().extra`` key prefixes of the per-tenant figures (the tenant's label follows), which
#: :mod:`kvplug.core.tenant_metrics` turns into metrics.
TENANT_BYTES = "tenant_bytes:"
TENANT_HITS = "tenant_hits:"
#: ``stats().extra`` key prefix of a tenant's bytes in a folder that several processes share
#: (tiers ``disk`` and ``shm``: every process's records, where ``tenant_bytes:`` is this process's).
FOLDER_TENANT_BYTES = "folder_tenant_bytes:"
#: The ``stats().extra`` figure of a store several processes share (a disk folder): the bytes
#: every live process pins in it, summed (``kvplug_folder_pinned_bytes``).
FOLDER_PINNED_BYTES = "folder_pinned_bytes"
#: ``stats().extra`` key prefix of the stores a tier refused, by reason (``pins``, ``quota``).
STORES_REFUSED = "stores_refused:"
#: Chunk keys the pin book remembers by default (about 450 bytes each: ~28 MiB).
DEFAULT_MAX_PINS = 65536

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_PERSON = b"kvplug-tenant"


class TenancyConfig(CheckedModel):
    """Engine-wide pin and tenant settings (``tenancy:``); each tier's pin budgets and quotas
    are its own (:class:`~kvplug.core.tenancy_settings.TenancySettings`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_pins: bool = Field(
        default=False,
        description="Honour pins asked for by requests (pin_request; engine adapters map their request flag to it, e.g. "
        "kvplug.pin). "
        "Off (the default): any API client could otherwise pin what it stores, so such a request stores as "
        "usual and its pin is ignored, counted (kvplug_request_pins_ignored_total) and logged (at most once a "
        "minute). On: a tenant's request pins stay within each tier's request_pin_max_bytes and count against "
        "its quota; pins of the config's pin: list and of kvplug ctl pin displace them when pin_max_bytes is spent.",
    )
    max_pins: int = Field(
        default=DEFAULT_MAX_PINS,
        ge=1,
        le=1 << 24,
        description="Chunk keys the engine's pin book remembers (to pin chunks when they are stored; about "
        "450 bytes each). In a full book a new pin takes the place of the oldest request pin (its chunks stay "
        "pinned where held); when the book holds operator pins only (pin:, kvplug ctl pin, CacheEngine.pin), "
        "a new pin is refused and said so: kvplug ctl pin and CacheEngine.pin answer book_full, "
        "kvplug_pin_book_full_total{origin} counts it.",
    )
    tenants: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="Tenant names: {name: cache_salt}. Metrics and stats label a tenant by its name, and quotas "
        "may name it instead of its salt. A salt is never a label: an unnamed salt a tier's quotas name is "
        "labelled salt-<digest> (keyed: see docs/security.md), any other salt (other). Names: letters, digits, "
        "'_', '.', '-', at most 64, not 'default'. The salts are secrets: config show masks them.",
    )

    @field_validator("tenants")
    @classmethod
    def _names(cls, tenants: dict[str, SecretStr]) -> dict[str, SecretStr]:
        seen: dict[str, str] = {}
        for name, secret in tenants.items():
            salt = secret.get_secret_value()
            if not _NAME.match(name) or name == DEFAULT_QUOTA or name.startswith(DIGEST_LABEL):
                raise ValueError(
                    f"tenants: {name!r} is not a tenant name: 1 to 64 letters, digits, '_', '.', '-' "
                    f"(not 'default', not starting with {DIGEST_LABEL!r})"
                )
            if not salt:
                raise ValueError(f"tenants[{name!r}]: the cache_salt is empty")
            if salt == name:
                raise ValueError(f"tenants[{name!r}]: the name is the salt itself; a label must not show the salt")
            if salt in seen:
                raise ValueError(f"tenants: {seen[salt]!r} and {name!r} have the same cache_salt")
            seen[salt] = name
        return tenants


class TenantLabels:
    """A tenant's label in metrics and stats: its configured name, ``salt-<digest>`` for an
    unnamed salt a quota counts apart, ``(other)`` for the rest, ``(unsalted)``.

    The digest is blake2b keyed with ``key`` (by default 32 random bytes of this process):
    a digest of the salt alone could be matched by anyone hashing a list of likely salts
    (``tenant-a``, customer ids). With a process key the label is stable while the engine
    runs, not across restarts or ranks: name tenants to keep their series."""

    def __init__(self, names: Mapping[str, str] | None = None, key: bytes | None = None) -> None:
        self._salts = dict(names or {})  # name -> salt
        self._names = {salt: name for name, salt in self._salts.items()}
        self._key = key if key is not None else os.urandom(32)

    @classmethod
    def from_config(cls, config: TenancyConfig, key: bytes | None = None) -> TenantLabels:
        return cls({name: salt.get_secret_value() for name, salt in config.tenants.items()}, key)

    def salt_of(self, name: str) -> str | None:
        """The salt a configured name stands for."""
        return self._salts.get(name)

    def quota_salts(self, quotas: Mapping[str, int]) -> dict[str, int]:
        """``quotas`` keyed by salt: a configured name stands for its salt, any other key is a salt."""
        return {self._salts.get(name, name): size for name, size in quotas.items()}

    def label(self, salt: str | None, counted: Container[str] = ()) -> str:
        """The label of tenant ``salt``; ``counted``: the salts a tier keeps figures of apart."""
        if salt is None:
            return UNSALTED
        name = self._names.get(salt)
        if name is not None:
            return name
        if salt in counted:
            digest = hashlib.blake2b(salt.encode(), key=self._key, digest_size=6, person=_PERSON)
            return DIGEST_LABEL + digest.hexdigest()
        return OTHER_TENANTS
