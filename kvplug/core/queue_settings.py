"""``QueueSettings``: the one vocabulary of kvplug's write-behind queues.

Two kinds of queue use it: the engine's store queue (``store.queue``: chunks on their
way from a store call to the tier chain) and each tier's write queue (``tiers[i].queue``,
owned by the tier chain: values on their way into one tier). Each owner has defaults
of its own (the store queue is async and blocks; a remote or disk tier's queue is
async, a cpu tier's sync); a partial ``queue:`` mapping changes only the keys it names
(:func:`complete_queue`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import ByteSize, ConfigDict, Field

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


def complete_queue(model: type[CheckedModel], data: Any) -> Any:
    """``data`` (the raw input of ``model``) with its ``queue`` completed from ``model``'s
    own default queue, so a partial mapping keeps the owner's defaults for the keys it
    does not name."""
    if not isinstance(data, Mapping):
        return data
    given = data.get("queue")
    if isinstance(given, QueueSettings):
        given = given.model_dump(exclude_unset=True)
    elif given is not None and not isinstance(given, Mapping):
        return data  # pydantic reports it
    default = model.model_fields["queue"].get_default(call_default_factory=True)
    if not isinstance(default, QueueSettings):
        return data
    return {**data, "queue": {**default.model_dump(), **(given or {})}}
