"""Building a :class:`kvplug.CacheEngine` for one SGLang device KV pool.

Everything SGLang-facing in this package (connector, radix-cache backend) goes
through :func:`build_cache_engine`, so chunk keys carry the same fingerprint
whichever way kvplug was turned on: model path and revision, dtype, the
``sglang_mha`` layout with its page size, the tensor-parallel rank and size, and what
the server that published its settings runs differently (an fp8 KV cache's format and
scales, quantized weights, an overridden model config).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import kvplug
from kvplug.errors import LayoutError
from kvplug_sglang.page_identity import kv_cache_variant, loaded_revision, weights_variant

logger = logging.getLogger("kvplug.sglang")

#: The setting SGLang overrides (:func:`scheduler_safe`), as the loader's sources name it.
ON_FULL = "store.queue.on_full"

#: ``MHATokenToKVPool``: per layer a ``k_buffer`` and a ``v_buffer``, each
#: [num_slots, num_kv_heads, head_dim], addressed by token slot (the page size only
#: groups slots; it is part of the fingerprint, not of the addressing).
SGLANG_MHA = kvplug.PagedFormat(
    "sglang_mha",
    ("slot", "head", "dim"),
    tensors=2,
    shape_doc="(k_buffer, v_buffer), each [num_slots, num_kv_heads, head_dim]",
)


def model_id_of(model_config: Any) -> str:
    """The model identity that goes into the fingerprint.

    SGLang's ``ModelConfig`` has ``model_path`` (a hub id or local directory) and
    ``revision``; anything with those attributes works (duck-typed).
    """
    model_id = getattr(model_config, "model_path", None) or getattr(model_config, "model_name", None)
    if not model_id:
        raise LayoutError("model_config has no model_path: cannot fingerprint the cached KV")
    return str(model_id)


def sglang_layout(
    k_pool: Sequence[torch.Tensor], v_pool: Sequence[torch.Tensor], page_size: int = 1
) -> kvplug.KVLayout:
    """The ``sglang_mha`` layout of an ``MHATokenToKVPool``'s ``k_buffer``/``v_buffer`` lists."""
    if not k_pool or len(k_pool) != len(v_pool):
        raise LayoutError(
            f"k_pool and v_pool must be non-empty lists of the same length (one tensor per layer), "
            f"got {len(k_pool)} and {len(v_pool)}"
        )
    first = k_pool[0]
    if first.dim() != 3:
        raise LayoutError(
            f"SGLang MHA buffers must be [num_slots, num_kv_heads, head_dim], got shape {tuple(first.shape)}; "
            "HND layouts (SGLANG_USE_HND_KVCACHE) and MLA pools are not supported"
        )
    for k, v in zip(k_pool, v_pool):
        if k.shape != first.shape or v.shape != first.shape or k.dtype != first.dtype or v.dtype != first.dtype:
            raise LayoutError(
                "every layer's k and v buffers must share shape and dtype "
                f"(layer 0: {tuple(first.shape)} {first.dtype}, got {tuple(k.shape)} {k.dtype} / {tuple(v.shape)} {v.dtype})"
            )
    return kvplug.KVLayout(
        format=SGLANG_MHA,
        num_layers=len(k_pool),
        block_size=page_size,
        num_kv_heads=first.shape[1],
        head_dim=first.shape[2],
        dtype=first.dtype,
    )


def load_kvplug_config(engine_extra: Mapping[str, Any] | None = None) -> kvplug.KVPlugConfig:
    """kvplug's config: defaults < ``KVPLUG_CONFIG`` YAML < ``KVPLUG_*`` env < ``engine_extra``.

    The radix-cache backend has no engine-side extra config (SGLang has no
    generic field for it), so there it is the file and the environment, e.g.
    ``KVPLUG_CONFIG=/etc/kvplug.yaml`` or ``KVPLUG_TIERS='[{"type": "cpu"}]'``.
    """
    loaded = kvplug.load_config(engine_extra=engine_extra or {})
    source = loaded.sources.get(ON_FULL)
    if source is not None and loaded.config.store.queue.on_full == "block":
        # The loader completes every field of the queue, so the config alone cannot tell
        # this choice from the default: the layer that set it can.
        logger.warning(
            "kvplug: %s: block (set in %s) does not apply under SGLang: a store runs on SGLang's "
            "scheduler thread, where waiting for room would stall every request; a store the full "
            'queue cannot take is dropped and counted (kvplug_store_dropped_total{queue="engine"}), '
            "as with on_full: drop",
            ON_FULL,
            _layer_name(source),
        )
    return loaded.config


def _layer_name(source: str) -> str:
    """The config layer ``source`` (the loader's name for it) as an operator finds it."""
    if source == "env":
        return "env KVPLUG_STORE__QUEUE__ON_FULL (or KVPLUG_STORE)"
    if source == "engine":
        return "the engine's extra config (kvplug.store.queue.on_full)"
    return source  # "file <path>"


def build_cache_engine(
    *,
    model_config: Any,
    k_pool: Sequence[torch.Tensor],
    v_pool: Sequence[torch.Tensor],
    tp_rank: int = 0,
    tp_size: int = 1,
    page_size: int = 1,
    config: kvplug.KVPlugConfig | None = None,
    engine_extra: Mapping[str, Any] | None = None,
    first_layer: int = 0,
) -> kvplug.CacheEngine:
    """A cache engine over SGLang's per-layer ``k_pool``/``v_pool`` tensors; ``first_layer``:
    the model layer of the pool's first (a pipeline stage's pool holds a slice of them).
    The store queue never blocks (:func:`scheduler_safe`); when kvplug's config is loaded
    here (``config`` not given) an ``on_full: block`` set in it is named in a warning."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank must be in [0, tp_size={tp_size}), got {tp_rank}")
    layout = sglang_layout(k_pool, v_pool, page_size)
    _check_against_model(model_config, layout, tp_size)
    config = scheduler_safe(config if config is not None else load_kvplug_config(engine_extra))
    if config.chunk_size % page_size:
        raise ValueError(
            f"kvplug chunk_size ({config.chunk_size}) must be a multiple of SGLang's page size ({page_size})"
        )
    fingerprint = kvplug.Fingerprint.for_layout(
        layout,
        model_id=model_id_of(model_config),
        model_revision=loaded_revision(model_id_of(model_config), getattr(model_config, "revision", None)),
        # SGLang keeps an fp8 KV cache in uint8 pools (e4m3 and e5m2 alike, scaled by a file):
        # the pool's dtype does not tell them apart, the server's settings do; so do its weights.
        engine_variant=_layer_slice(model_config, layout, first_layer) + kv_cache_variant() + weights_variant(),
        tp_rank=tp_rank,
        tp_size=tp_size,
    )
    return kvplug.CacheEngine(config, layout, fingerprint)


def scheduler_safe(config: kvplug.KVPlugConfig) -> kvplug.KVPlugConfig:
    """``config`` with a store queue that never waits for room (``on_full: drop``).

    SGLang stores on its scheduler thread, between batches: a full queue that blocked
    (the store queue's default, up to ``block_timeout_s``) would stall every request the
    server runs while the tiers are stuck. A store the queue cannot take at once is shed
    and counted (``kvplug_store_dropped_total{queue="engine"}``); its KV stays on device.
    """
    queue = config.store.queue
    if queue.on_full == "drop":
        return config
    store = config.store.model_copy(update={"queue": queue.model_copy(update={"on_full": "drop"})})
    return config.model_copy(update={"store": store})


def _layer_slice(model_config: Any, layout: kvplug.KVLayout, first_layer: int) -> str:
    """The model layers a pipeline stage's pool holds (``""`` for all of them): two stages of
    as many layers each have one layout, and must not read each other's KV."""
    layers = getattr(model_config, "num_hidden_layers", None)
    if first_layer == 0 and (not isinstance(layers, int) or layers == layout.num_layers):
        return ""
    return f"layers:{first_layer}-{first_layer + layout.num_layers}"


def _check_against_model(model_config: Any, layout: kvplug.KVLayout, tp_size: int) -> None:
    """Catch a pool that belongs to another model (or another TP split) early."""
    layers = getattr(model_config, "num_hidden_layers", None)
    # Pipeline parallelism gives a rank a slice of the layers; the pool is the truth.
    if isinstance(layers, int) and layers != layout.num_layers and not (0 < layout.num_layers < layers):
        raise LayoutError(f"the KV pool has {layout.num_layers} layers, the model {layers}")
    get_heads = getattr(model_config, "get_num_kv_heads", None)
    if callable(get_heads):
        heads = get_heads(tp_size)
        if isinstance(heads, int) and heads != layout.num_kv_heads:
            raise LayoutError(
                f"the KV pool has {layout.num_kv_heads} KV heads per rank, the model {heads} at tp_size={tp_size}"
            )
