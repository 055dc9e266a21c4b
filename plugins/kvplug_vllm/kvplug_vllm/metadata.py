"""What the scheduler-side connector tells the worker-side one each step.

In vLLM's multiprocess engine this object crosses a process boundary inside the
``SchedulerOutput`` (vLLM serializes it), so it holds plain data only: lists of
ints and strings, no tensors and no references to scheduler objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvplug import ExtraKey, RequestInfo


@dataclass
class LoadSpec:
    """Load ``[num_computed, num_computed + num_external)`` out of the cached ``[0, num_hit)``."""

    num_computed: int
    num_hit: int
    num_external: int
    #: Load in the background; the worker reports completion through ``get_finished``.
    background: bool = False
    #: The lookup's hash of each chunk of ``[0, num_hit)`` (empty: not known): the worker
    #: names the chunks by them rather than hashing the prompt again.
    chunk_hashes: list[str] = field(default_factory=list)


@dataclass
class RequestMeta:
    """One request's load and/or store in this step."""

    req_id: str
    token_ids: list[int]
    #: The blocks of KV cache group 0 (vLLM's ``block_ids[0]``).
    block_ids: list[int]
    #: Every KV cache group's blocks, a hybrid model only (empty: one group, ``block_ids``).
    group_block_ids: list[list[int]] = field(default_factory=list)
    cache_salt: str | None = None
    lora_id: str | None = None
    extra_keys: list[tuple[int, int, str]] = field(default_factory=list)
    overrides: dict[str, Any] = field(default_factory=dict)
    load: LoadSpec | None = None
    #: Store the chunks of ``token_ids[:save_end]``; the first ``save_start`` are stored already.
    save_start: int = 0
    save_end: int = 0
    #: vLLM's hash of each full block of ``token_ids`` as its KV events publish it (only when
    #: KV events are on): the worker names kvplug's chunks by them in its own events.
    block_hashes: list[Any] = field(default_factory=list)
    #: Recurrent states vLLM handed over this step (``align`` mode): (KV cache group, block id,
    #: token boundary) each. The worker stores each as the state group's chunk ending there.
    state_blocks: list[tuple[int, int, int]] = field(default_factory=list)
    #: How many times vLLM rolled the request back (preempted, or after a failed load) before this
    #: step: a worker whose load of the request failed stores nothing of it until this grows.
    epoch: int = 0
    #: The tokens ``[start, end)`` this step computes: the blocks before ``start`` are what its
    #: forward reads as context (loaded ones included).
    computes: tuple[int, int] = (0, 0)

    def request_info(self) -> RequestInfo:
        return RequestInfo(
            cache_salt=self.cache_salt,
            lora_id=self.lora_id,
            extra_keys=tuple(ExtraKey(start, end, value) for start, end, value in self.extra_keys),
            overrides=dict(self.overrides),
        )


@dataclass
class KVPlugConnectorMetadata(KVConnectorMetadata):
    """The step's requests that load or store anything."""

    requests: list[RequestMeta] = field(default_factory=list)
    #: The step computes nothing (every request waits, e.g. for its background load).
    idle: bool = False
    #: Requests that finished since the last step (vLLM's ``finished_req_ids``): the worker forgets
    #: them as the step begins, before its loads, since a new request may reuse the id in this step.
    finished_req_ids: list[str] = field(default_factory=list)
    #: Blocks (of ``block_ids``' group) that scheduled requests not in ``requests`` (they load and
    #: store nothing) write this step: a block that did not load last step and is computed again
    #: here is fine for the requests that read it (:meth:`LoadResults.refuse_sharers`).
    computed_blocks: list[int] = field(default_factory=list)
