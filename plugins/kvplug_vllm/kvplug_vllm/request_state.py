"""What the scheduler side knows of one request: one object per request, with an explicit phase.

A request goes through these phases (vLLM calls in brackets)::

    LOOKING_UP --> LOOKED_UP --> RUNNING                     (get_num_new_matched_tokens,
         |             |            ^                         update_state_after_alloc,
         |             v            |                         build_connector_meta)
         |        LOAD_QUEUED --> LOADING --> LOAD_FAILED --> RUNNING

- ``LOOKING_UP``: its lookup runs in the background; vLLM was told to ask again.
- ``LOOKED_UP``: its latest lookup is answered (vLLM may ask again before it admits it; a
  preempted running request comes back here).
- ``LOAD_QUEUED``: admitted with a background load, which goes into the next step's metadata.
- ``LOADING``: that load was sent; vLLM keeps the request in ``WAITING_FOR_REMOTE_KVS``.
- ``LOAD_FAILED``: vLLM asked about it again, so its background load failed with nothing valid
  and vLLM computes the prompt (every ask until vLLM admits it says so: no new lookup).
- ``RUNNING``: scheduled; each step stores the chunks its KV completes (:mod:`kvplug_vllm.plan`).

The request's kvplug settings (``kv_transfer_params``) are validated once, when its state is
made, into the config it stores with.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

from kvplug import ExtraKey, KVPlugConfig, RequestInfo
from kvplug.errors import ConfigError
from kvplug_vllm.lookup_pool import Tiers
from kvplug_vllm.lookup_result import LookupResult
from kvplug_vllm.settings import kvplug_params, request_overrides

logger = logging.getLogger("kvplug.vllm")


class Phase(enum.Enum):
    """Where a request is in its lookup, load and store (see the module docstring)."""

    LOOKING_UP = "looking_up"
    LOOKED_UP = "looked_up"
    LOAD_QUEUED = "load_queued"
    LOADING = "loading"
    LOAD_FAILED = "load_failed"
    RUNNING = "running"


@dataclass
class Progress:
    """A scheduled request's blocks and stores, and what its report says (kept across preemption)."""

    prompt_len: int
    #: Every KV cache group's block ids, by group.
    blocks: list[list[int]]
    num_saved: int = 0
    num_computed: int = 0
    hit_tokens: int = 0
    vllm_cached_tokens: int = 0
    external_tokens: int = 0
    #: Times its computed count went back (preempted, or rolled back after a failed load).
    rollbacks: int = 0

    def report(self) -> dict[str, int]:
        return dict(
            hit_tokens=self.hit_tokens,
            vllm_cached_tokens=self.vllm_cached_tokens,
            external_tokens=self.external_tokens,
        )


@dataclass
class RequestState:
    """One request on the scheduler side: its phase and everything kvplug keeps of it."""

    req_id: str
    info: RequestInfo
    #: The shared config with the request's own settings: what it stores by.
    config: KVPlugConfig
    phase: Phase = Phase.LOOKED_UP
    #: vLLM's request, once vLLM allocated its blocks.
    request: Any = None
    #: The latest ask's lookup, until the step that admits (and maybe loads) it takes it.
    lookup: LookupResult | None = None
    #: A background lookup's answer, kept until vLLM admits the request (the same answer for each ask).
    answer: Tiers | None = None
    #: The background load (phases LOAD_QUEUED, LOADING, LOAD_FAILED).
    load: LookupResult | None = None
    #: Set once vLLM schedules the request.
    progress: Progress | None = None
    #: The prompt length ``info`` keys (a streaming-input session's turn makes it longer).
    keyed_tokens: int = 0

    @classmethod
    def of(cls, request: Any, config: KVPlugConfig) -> RequestState:
        """A new request's state, its kvplug settings validated (once: here); bad ones are
        logged and ignored."""
        info = request_info(request, config, with_overrides=False)
        overrides: dict[str, Any] = {}
        own = config
        try:
            overrides = kvplug_params(request.kv_transfer_params)
            if overrides:
                own = config.with_overrides(overrides, source="kv_transfer_params")
        except ConfigError as exc:  # one request's bad settings must not stop vLLM's scheduler
            logger.warning("request %s: ignoring kvplug settings in kv_transfer_params: %s", request.request_id, exc)
            overrides, own = {}, config
        return cls(
            request.request_id,
            dataclasses.replace(info, overrides=overrides),
            own,
            keyed_tokens=request.num_prompt_tokens,
        )

    def follow(self, request: Any) -> None:
        """Key the request's prompt as it is now: the next turn of a streaming-input session
        extends it under the same id, with the multimodal items of that turn, whose chunks
        would otherwise be keyed by their placeholder ids alone (those of any image)."""
        if request.num_prompt_tokens != self.keyed_tokens:
            info = request_info(request, self.config, with_overrides=False)
            self.info = dataclasses.replace(info, overrides=self.info.overrides)
            self.keyed_tokens = request.num_prompt_tokens


def request_info(request: Any, config: KVPlugConfig, *, with_overrides: bool = True) -> RequestInfo:
    """Isolation and extra keys of a vLLM request: cache_salt, LoRA (its name, and its path
    as an extra key), multimodal inputs, prompt embeddings.

    Each multimodal item becomes an :class:`kvplug.ExtraKey` over its placeholder
    tokens, so two prompts with equal placeholder ids but different images never
    share those chunks; prompt embeddings likewise (:func:`embeds_keys`). Raises
    ``ConfigError`` for bad kvplug ``kv_transfer_params``.
    """
    lora = getattr(request, "lora_request", None)
    # vLLM's own prefix cache keys an adapter by name and path: one name re-pointed at
    # other weights computes other KV.
    extra_keys = list(ExtraKey.adapter_keys(lora.lora_path if lora is not None else None))
    extra_keys += embeds_keys(request, config.chunk_size)
    for feature in getattr(request, "mm_features", None) or ():
        position = feature.mm_position
        value = feature.mm_hash or feature.identifier
        extra_keys.append(ExtraKey(position.offset, position.offset + position.length, f"{feature.modality}:{value}"))
    overrides = request_overrides(request.kv_transfer_params, config) if with_overrides else {}
    return RequestInfo(
        cache_salt=getattr(request, "cache_salt", None),
        lora_id=lora.lora_name if lora is not None else None,
        extra_keys=tuple(extra_keys),
        overrides=overrides,
    )


def prompt_ids(request: Any) -> list[int]:
    """The token ids kvplug keys a request's prompt by, in lookups as in stores: vLLM's
    ``all_token_ids`` of it.

    They are its ``prompt_token_ids`` but where vLLM computes from embeddings: there they are
    0 (``prompt_token_ids`` is None, or holds placeholder ids where ``prompt_is_token_ids``
    is False); the embeddings key those chunks (:func:`embeds_keys`).
    """
    return list(request.all_token_ids[: request.num_prompt_tokens])


def embeds_keys(request: Any, chunk_size: int) -> list[ExtraKey]:
    """Extra keys of a prompt vLLM computes from embeddings (``prompt_embeds``), at least in part.

    Its token ids are placeholders where the embeddings go (all of them, or where
    ``prompt_is_token_ids`` is False): keyed by its ids alone, its chunks would be those of
    any prompt of the same ids. Each chunk's span gets the SHA-256 of its embeddings and
    of which positions take them, so prompts of equal embeddings share chunks up to the
    first that differs, as vLLM's own prefix cache keys them by block.
    """
    embeds = getattr(request, "prompt_embeds", None)
    if embeds is None:
        return []
    mask = getattr(request, "prompt_is_token_ids", None)
    values = embeds.detach().to("cpu").contiguous()
    keys = []
    for start in range(0, int(values.shape[0]), chunk_size):
        end = min(start + chunk_size, int(values.shape[0]))
        digest = hashlib.sha256(f"{values.dtype}/{tuple(values.shape[1:])}/".encode())
        digest.update(b"all" if mask is None else bytes(bool(t) for t in mask[start:end]))
        digest.update(values[start:end].view(torch.uint8).numpy().tobytes())
        keys.append(ExtraKey(start, end, f"prompt_embeds:{digest.hexdigest()}"))
    return keys


def isolation(info: RequestInfo) -> dict[str, Any]:
    """The RequestMeta fields that key a request's chunks."""
    return dict(
        cache_salt=info.cache_salt,
        lora_id=info.lora_id,
        extra_keys=[(k.start, k.end, k.value) for k in info.extra_keys],
    )
