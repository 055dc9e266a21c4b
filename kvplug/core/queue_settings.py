"""``QueueSettings``: the one vocabulary of kvplug's write-behind queues.

Two kinds of queue use it: the engine's store queue (``store.queue``: chunks on their
way from a store call to the tier chain) and each tier's write queue (``tiers[i].queue``,
owned by the tier chain: values on their way into one tier). Each owner has defaults
of its own (the store queue is async and blocks; a remote or disk tier's queue is
async, a cpu tier's sync); a partial ``queue:`` mapping changes only the keys it names.

The keys of kvplug 0.2 (``write_mode``, ``write_queue_items``, ``store.queue_max_batches``
...) still work for one release: :func:`upgrade_queue_keys` maps each to its new key
with a ``FutureWarning`` naming it (shown by default: the reader is an operator).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ByteSize, ConfigDict, Field, ValidationInfo

from kvplug.core.components import CheckedModel
from kvplug.core.config_types import QueueItems, TimeoutSeconds


class QueueSettings(CheckedModel):
    """A bounded write-behind queue: how writes are handed over, bounded and ended.

    For a tier, ``sync`` means the caller's thread (the store worker) writes it; ``async``
    means the tier chain's write queue for that tier does, so a slow tier never delays
    faster ones. Values in an async tier's queue are readable at once (``get`` and
    ``contains`` answer from the queue), a second write of a queued key replaces it, and
    a ``remove`` cancels it. For the store queue, ``sync`` means the store call itself
    writes the tiers.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Literal["sync", "async"] = Field(
        default="sync", description="sync: the caller's thread writes; async: a bounded queue and its thread do."
    )
    max_items: QueueItems = Field(default=1024, description="Bound of the queue, in batches (async only).")
    max_bytes: ByteSize = Field(
        default=ByteSize(256 * 1024**2),
        gt=0,
        description="Bound of the queue in bytes of values, queued and being written (async only): "
        "queued values are held in memory until written.",
    )
    on_full: Literal["block", "drop"] = Field(
        default="drop",
        description="When the queue is full: wait for room (up to block_timeout_s, then drop) or drop at once. "
        "Drops are counted (kvplug_store_dropped_total).",
    )
    block_timeout_s: TimeoutSeconds = Field(
        default=30.0, description="With on_full: block, the longest a write waits for room before it is dropped."
    )
    on_close: Literal["drain", "drop"] = Field(
        default="drain", description="What close does with writes still queued: write them, or drop them."
    )


@dataclass(frozen=True)
class OldQueueKey:
    """A kvplug 0.2 key that became ``queue.<key>``; ``values`` maps old values to new
    ones (an old value mapped to ``None`` sets nothing: it was that owner's default)."""

    key: str
    values: Mapping[Any, Any] = field(default_factory=dict)


#: The keys every tier had before ``queue``.
TIER_QUEUE_KEYS: dict[str, OldQueueKey] = {
    "write_mode": OldQueueKey("mode"),
    "write_queue_items": OldQueueKey("max_items"),
    "write_queue_bytes": OldQueueKey("max_bytes"),
    "on_queue_full": OldQueueKey("on_full"),
}
#: The keys of ``store`` before ``store.queue``.
STORE_QUEUE_KEYS: dict[str, OldQueueKey] = {
    "mode": OldQueueKey("mode"),
    "queue_max_batches": OldQueueKey("max_items"),
    "queue_max_bytes": OldQueueKey("max_bytes"),
    "on_full": OldQueueKey("on_full"),
    "block_timeout_s": OldQueueKey("block_timeout_s"),
}


def upgrade_queue_keys(
    model: type[CheckedModel], data: Any, old_keys: Mapping[str, OldQueueKey], path: str, info: ValidationInfo | None
) -> Any:
    """``data`` (the raw input of ``model``) with its old queue keys moved into ``queue``
    and ``queue`` completed from ``model``'s own default, so a partial mapping keeps the
    owner's defaults for the keys it does not name.

    Each old key warns (``FutureWarning``) naming the key to use. An old key and
    its new key with different values, or two old keys that disagree, are a
    ``ValueError`` naming both. ``path`` names the entry (``store``); a validation
    context's ``path`` (``tiers[1]``) wins.
    """
    if not isinstance(data, Mapping):
        return data
    context = info.context if info is not None else None
    if isinstance(context, Mapping) and isinstance(context.get("path"), str):
        path = context["path"]
    prefix = f"{path}." if path else ""
    data = dict(data)
    given = data.get("queue")
    if isinstance(given, QueueSettings):
        given = given.model_dump(exclude_unset=True)
    elif given is not None and not isinstance(given, Mapping):
        return data  # pydantic reports it
    queue: dict[str, Any] = dict(given or {})
    upgraded: dict[str, tuple[str, Any, Any]] = {}  # field -> (old key, old value, new value)
    for old, how in old_keys.items():
        if old not in data:
            continue
        raw = data.pop(old)
        new = f"{prefix}queue.{how.key}"
        warnings.warn(
            f"{prefix}{old} is deprecated and will be removed in a later release: use {new}",
            # A FutureWarning, not a DeprecationWarning: the reader is whoever wrote the config
            # (an operator), and Python shows FutureWarnings by default.
            FutureWarning,
            stacklevel=2,
        )
        value = how.values.get(raw, raw) if isinstance(raw, str) else raw
        if value is None:
            continue
        earlier = upgraded.get(how.key)
        if earlier is not None and earlier[2] != value:
            if how.key == "mode" and "async" in (earlier[2], value):
                # 0.2's queues were stacked: a write was asynchronous if any of them was.
                value = "async"
            else:
                raise ValueError(
                    f"{prefix}{earlier[0]} ({earlier[1]!r}) and {prefix}{old} ({raw!r}) both set {new}: set only {new}"
                )
        upgraded[how.key] = (old, raw, value)
    for name, (old, raw, value) in upgraded.items():
        if name in queue and queue[name] != value:
            raise ValueError(
                f"{prefix}{old} ({raw!r}) conflicts with {prefix}queue.{name} ({queue[name]!r}): "
                f"set only {prefix}queue.{name}"
            )
        queue[name] = value
    default = model.model_fields["queue"].get_default(call_default_factory=True)
    if isinstance(default, QueueSettings):
        queue = {**default.model_dump(), **queue}
    data["queue"] = queue
    return data
