"""kvplug's request identity of an SGLang radix key: its ``cache_salt``, its ``extra_key``, and
the LoRA adapter the request ran with, keyed by where the adapter's weights came from.

SGLang names a LoRA adapter in its radix keys by ``lora_id`` (appended to the request's
``extra_key``): a fresh id each time an adapter is loaded at runtime, so keyed by it a chunk
would miss after a restart and on every other server of a fleet. kvplug keys it as vLLM's
adapter does: the adapter's name, and its source path (``LoRARef.lora_path``, as loaded)
through :meth:`kvplug.ExtraKey.adapter_source` (its files' content where kvplug can read
them, taken when a load's id is first seen). The same files hit everywhere; a name re-pointed
at other weights, or files rewritten and reloaded at the same path, never do. An adapter
whose path cannot be known (loaded from tensors, or no longer loaded when first seen) keeps
SGLang's per-load key: a miss elsewhere, never a key shared with other weights.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import kvplug
from kvplug_sglang.page_identity import weights_keys

#: What ``LoRARef.lora_path`` holds for an adapter SGLang loaded from tensors: not a source.
_TENSOR_SOURCE = "__tensor__"


@dataclass(frozen=True)
class _Adapter:
    lora_id: str
    name: str
    source: str
    rest: str  # the extra_key without the LoRA id (the caller's own part, SGLang's namespaces)
    # Taken when the load's id is first seen, just after SGLang read the files: files
    # rewritten later are not this load's weights until a reload (a new lora_id).
    key: kvplug.ExtraKey


def lora_refs_of(tp_worker: Any) -> Callable[[], Mapping[str, Any]]:
    """The live ``lora_id -> LoRARef`` table of a scheduler's LoRA manager (empty without LoRA)."""

    def refs() -> Mapping[str, Any]:
        manager = getattr(getattr(tp_worker, "model_runner", None), "lora_manager", None)
        table = getattr(manager, "lora_refs", None)
        return table if isinstance(table, Mapping) else {}

    return refs


class RequestKeys:
    """:class:`kvplug.RequestInfo` of SGLang radix keys, LoRA adapters keyed by their source.

    A radix node carries only its key (``extra_key`` with the LoRA id in it); the request
    that matched it names the id. What each ``extra_key`` resolved to for a request is
    remembered (the ``limit`` most recent), so a node stored later (evicted, maybe after its
    adapter was unloaded) keeps its keys. A request is keyed by its own ``lora_id`` alone: a
    request without one whose ``extra_key`` (which clients set) spells an adapter's is never
    keyed as that adapter.
    """

    def __init__(self, lora_refs: Callable[[], Mapping[str, Any]], *, limit: int = 4096) -> None:
        self._lora_refs = lora_refs
        self._limit = limit
        self._adapters: OrderedDict[str, _Adapter] = OrderedDict()

    def for_request(self, key: Any, lora_id: str | None) -> kvplug.RequestInfo | None:
        """The identity of a request's radix key ``key``; ``lora_id``: its ``Req.lora_id``."""
        known = self._adapters.get(key.extra_key) if key.extra_key else None
        if known is not None and known.lora_id == lora_id:
            self._adapters.move_to_end(key.extra_key)
        else:
            known = self._resolve(key.extra_key, lora_id) if key.extra_key and lora_id else None
        return self._info(key, known)

    def for_node(self, key: Any) -> kvplug.RequestInfo | None:
        """The identity of a radix node's key, as a request with that key resolved it."""
        known = self._adapters.get(key.extra_key) if key.extra_key else None
        return self._info(key, known)

    @staticmethod
    def _info(key: Any, adapter: _Adapter | None) -> kvplug.RequestInfo | None:
        extra_key, salt = key.extra_key, key.cache_salt
        weights = weights_keys()  # weights updated in place since the server started
        if extra_key is None and salt is None and not weights:
            return None
        if adapter is None:
            return kvplug.RequestInfo(cache_salt=salt, lora_id=extra_key, extra_keys=weights)
        extra = [*weights, adapter.key]
        if adapter.rest:
            extra.append(kvplug.ExtraKey(0, 1, "extra_key:" + hashlib.sha256(adapter.rest.encode()).hexdigest()))
        return kvplug.RequestInfo(cache_salt=salt, lora_id=adapter.name, extra_keys=tuple(extra))

    def _resolve(self, extra_key: str, lora_id: str) -> _Adapter | None:
        if lora_id not in extra_key:
            return None
        ref = self._lora_refs().get(lora_id)
        source = getattr(ref, "lora_path", None)
        name = getattr(ref, "lora_name", None)
        if not source or source == _TENSOR_SOURCE or not name:
            return None
        before, _, after = extra_key.rpartition(lora_id)
        adapter = _Adapter(lora_id, str(name), str(source), before + after, kvplug.ExtraKey.adapter_source(str(source)))
        self._adapters[extra_key] = adapter
        while len(self._adapters) > self._limit:
            self._adapters.popitem(last=False)
        return adapter
