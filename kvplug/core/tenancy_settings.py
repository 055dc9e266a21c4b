"""Per-tier pin budgets and tenant quotas: the ``pin_max_bytes``, ``request_pin_max_bytes``
and ``quotas`` settings a tier that keeps pins mixes into its ``Config``
(:class:`TenancySettings`), and the byte-or-percentage shares they are written in."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import BaseModel, Field, field_validator, model_validator

from kvplug.core.config_types import parse_byte_size
from kvplug.core.tenants import DEFAULT_QUOTA

_PERCENT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")
#: The largest byte share a pin budget or quota may name: 1 PiB.
MAX_SHARE_BYTES = 2**50
#: The largest share of ``max_bytes`` pins may take, in percent: the rest is for chunks that can
#: be evicted, or a tier full of pins would have no room to store anything new.
MAX_PIN_PERCENT = 90


def parse_share(where: str, value: object) -> int | str:
    """A byte count (``4GiB``, ``1000``) or a percentage of the tier's budget (``"20%"``),
    normalised to an ``int`` or a ``"<number>%"`` string; ``ValueError`` names ``where``,
    the value and the bound. ``0%`` is ``0``: none (no pins, a tenant that stores nothing)."""
    if isinstance(value, str):
        match = _PERCENT.match(value)
        if match is not None:
            percent = float(match.group(1))
            if percent > 100:
                raise ValueError(f"{where}: {value!r} must be a percentage of at most 100")
            return f"{match.group(1)}%"
    if isinstance(value, bool):
        raise ValueError(f"{where}: {value!r} is not a byte size (4GiB) or a percentage (20%)")
    try:
        size = parse_byte_size(value)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}; or give a percentage (20%)") from None
    if not 0 <= size <= MAX_SHARE_BYTES:
        raise ValueError(f"{where}: {value!r} must be from 0 bytes to 1 PiB")
    return size


def bound_share(where: str, share: int | str, budget: int | None, *, at_most_percent: float, rest: str) -> None:
    """Refuse a share (:func:`parse_share`'s) of more than ``at_most_percent`` of the tier's
    ``budget`` (its ``max_bytes``; ``None``: only a percentage is checked): ``ValueError`` names
    ``where``, the share, the bound and what the rest of ``max_bytes`` is for (``rest``)."""
    if isinstance(share, str):
        over, said = float(share[:-1]) > at_most_percent, repr(share)
    else:
        over = budget is not None and share * 100 > budget * at_most_percent
        said = f"{share} bytes of max_bytes {budget}"
    if over:
        raise ValueError(
            f"{where}: {said} is too much: at most {at_most_percent:g}% of max_bytes, the rest is for {rest}"
        )


def share_bytes(share: int | str, budget: int | None) -> int | None:
    """The bytes a normalised share stands for (``None``: unbounded, a percentage of no budget)."""
    if isinstance(share, int):
        return share
    if budget is None:
        return None
    return int(budget * float(share[:-1]) / 100)


class TenancySettings(BaseModel):
    """Pin budget and per-tenant quotas of a tier (mixed into the ``Config`` of tiers
    that keep them: ``cpu``, ``disk``, ``shm``). Both are per tier, beside the tier's
    ``max_bytes`` they are shares of, because each tier evicts on its own."""

    pin_max_bytes: Annotated[int, Field(ge=0, le=MAX_SHARE_BYTES)] | str = Field(
        default="25%",
        description="Budget of pinned chunks in this tier (chunks no eviction policy evicts: config pin:, "
        "kvplug ctl pin / CacheEngine.pin, request pins where tenancy.request_pins allows them): bytes (1GiB) "
        f"or a percentage of max_bytes (25%), at most {MAX_PIN_PERCENT}% of max_bytes, so that unpinned chunks "
        "keep room. A pin over it is refused and counted (stats pins_refused). Per process: the engines (and "
        "ranks) sharing a disk or shm folder pin within that tier's folder_pin_max_bytes together, and its stats "
        "show the folder's pinned bytes summed over them (folder_pinned_bytes) (docs/operations.md). Not to be "
        "confused with pin_memory (page-locked host memory).",
    )
    request_pin_max_bytes: Annotated[int, Field(ge=0, le=MAX_SHARE_BYTES)] | str = Field(
        default="5%",
        description="Budget of each tenant's request pins in this tier (tenancy.request_pins; unsalted "
        "requests share one): bytes or a percentage of max_bytes. Request pins also count against the "
        "tenant's quota and stay within pin_max_bytes; a request pin over either is refused and counted.",
    )
    quotas: dict[str, int | str] = Field(
        default_factory=dict,
        description="Per-tenant (cache_salt) byte quotas: {default: 20%, tenant-a: 4GiB}; bytes or a "
        "percentage of max_bytes, each at most max_bytes; a key is a tenant name of tenancy.tenants or a salt. "
        "default applies to every salt not named; unsalted requests are no tenant. A tenant over its quota "
        "evicts its own chunks (in the eviction policy's order), never another's; pinned chunks count "
        "against it only when a request pinned them. A chunk larger than the quota is not stored (counted).",
    )

    @field_validator("pin_max_bytes", mode="before")
    @classmethod
    def _pin_share(cls, value: Any) -> int | str:
        share = parse_share("pin_max_bytes", value)
        bound_share("pin_max_bytes", share, None, at_most_percent=MAX_PIN_PERCENT, rest=_UNPINNED)
        return share

    @field_validator("request_pin_max_bytes", mode="before")
    @classmethod
    def _request_pin_share(cls, value: Any) -> int | str:
        return parse_share("request_pin_max_bytes", value)

    @field_validator("quotas", mode="before")
    @classmethod
    def _quota_shares(cls, value: Any) -> dict[str, int | str]:
        if not isinstance(value, Mapping):
            raise ValueError(f"quotas: {value!r} is not a mapping of tenant (cache_salt) to bytes or percentage")
        return {str(name): parse_share(f"quotas[{str(name)!r}]", share) for name, share in value.items()}

    @model_validator(mode="after")
    def _within_budget(self) -> TenancySettings:
        budget = getattr(self, "max_bytes", None)
        if budget is None:
            return self
        shares = {
            "pin_max_bytes": self.pin_max_bytes,
            "request_pin_max_bytes": self.request_pin_max_bytes,
            **{f"quotas[{n!r}]": s for n, s in self.quotas.items()},
        }
        for where, share in shares.items():
            if isinstance(share, int) and share > int(budget):
                raise ValueError(f"{where}: {share} bytes is more than the tier's max_bytes ({int(budget)})")
        bound_share("pin_max_bytes", self.pin_max_bytes, int(budget), at_most_percent=MAX_PIN_PERCENT, rest=_UNPINNED)
        return self

    def pin_budget(self) -> int | None:
        """Pinned bytes this tier may hold (``None``: unbounded)."""
        return share_bytes(self.pin_max_bytes, _budget(self))

    def request_pin_budget(self) -> int | None:
        """Bytes each tenant's request pins may hold in this tier (``None``: unbounded)."""
        return share_bytes(self.request_pin_max_bytes, _budget(self))

    def quota_bytes(self) -> tuple[dict[str, int], int | None]:
        """(byte quota of each named tenant, the ``default`` quota or ``None``)."""
        budget = _budget(self)
        named: dict[str, int] = {}
        default: int | None = None
        for name, share in self.quotas.items():
            size = share_bytes(share, budget)
            if size is None:
                continue
            if name == DEFAULT_QUOTA:
                default = size
            else:
                named[name] = size
        return named, default


#: What the rest of ``max_bytes`` beside ``pin_max_bytes`` is for (said when it is too much).
_UNPINNED = "chunks that can be evicted"


def _budget(settings: BaseModel) -> int | None:
    budget = getattr(settings, "max_bytes", None)
    return None if budget is None else int(budget)
