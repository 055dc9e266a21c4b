"""The vLLM worker's KV cache as a :class:`kvplug.KVLayout`, and its fingerprint.

The layout is read off the tensors vLLM registers, checked against the model
config, so a backend that allocates something else fails with a clear error
instead of copying the wrong bytes.

The four vLLM cache layouts kvplug reads are declared here as
:class:`kvplug.PagedFormat` values (the core knows no engine). vLLM's CPU backend
(``vllm_cpu``) packs the K half of every (block, head) page
per CPU instruction set: on ``vec`` (AVX-512/AVX2) K is stored transposed
(``[head_dim, block_size]``), ``amx`` tiles it for AMX, ``neon``/``vec16`` have
their own packing. The bytes of a block are only meaningful to a kernel of the
same ISA, so the ISA (and, for ``vec``, the vector width) goes into the key
fingerprint: a cache written on an AMX box is a miss, not garbage, on an AVX-512 one.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping

import torch

from kvplug import Fingerprint, HeadShard, KVLayout, PagedFormat, dtype_name
from kvplug.errors import ConfigError, ConfigProblem, LayoutError

logger = logging.getLogger("kvplug.vllm")

#: FlashAttention / FlashInfer / Triton backends: one tensor per layer, K then V.
VLLM_FLASH = PagedFormat(
    "vllm_flash",
    ("kv", "block", "token", "head", "dim"),
    shape_doc="[2, num_blocks, block_size, num_kv_heads, head_dim]",
)
#: MLA backends: one latent vector per token, no K/V split.
VLLM_MLA = PagedFormat(
    "vllm_mla", ("block", "token", "dim"), latent=True, shape_doc="[num_blocks, block_size, head_dim]"
)
#: vllm-cpu 0.32 allocates [num_blocks, num_kv_heads, block_size, 2 * head_dim]: each
#: (block, head) run is a K half then a V half (cpu_attn.py views it as
#: [.., 2 * block_size, head_dim]), but the K half is packed per CPU ISA (on AVX-512
#: "vec" it is [head_dim, block_size]). Blocks are therefore opaque: only whole blocks
#: are copied, and the ISA belongs in the fingerprint.
VLLM_CPU = PagedFormat(
    "vllm_cpu",
    ("block", "head", "kv", "token", "dim"),
    whole_blocks_only=True,
    shape_doc="[num_blocks, num_kv_heads, block_size, 2 * head_dim]",
)
#: vllm-cpu 0.32's MLA backends (CPU_MLA, AMX_MLA) get vLLM's generic [B, H, N, C]
#: cache view with one head: [num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim].
#: A token's latent row is plain (the backends write ``cache.view(-1, C)[slot]``, the
#: compressed KV then the rope key), so tokens are addressable one by one; the
#: backend's name still goes into the fingerprint (its kernels read these bytes).
VLLM_CPU_MLA = PagedFormat(
    "vllm_cpu_mla",
    ("block", "head", "token", "dim"),
    latent=True,
    shape_doc="[num_blocks, 1, block_size, kv_lora_rank + qk_rope_head_dim]",
)

#: A recurrent-state layer (Mamba, GDN) in vLLM's ``align`` mode: one page of raw state
#: bytes per block (conv and SSM state, padded to the attention page), viewed by
#: :func:`kvplug_vllm.state_groups.state_pages` as one chunk per page. Opaque and whole.
VLLM_STATE_PAGES = PagedFormat(
    "vllm_state_pages",
    ("block", "token", "dim"),
    latent=True,
    whole_blocks_only=True,
    shape_doc="[num_blocks, chunk_size, page_bytes / chunk_size] bytes (one state page per vLLM block)",
)


def detect_layout(kv_caches: Mapping[str, torch.Tensor], vllm_config: object) -> KVLayout:
    """The layout of the registered caches (all layers must agree)."""
    if not kv_caches:
        raise LayoutError("vLLM registered no KV cache tensors")
    model_config = vllm_config.model_config  # type: ignore[attr-defined]
    parallel_config = vllm_config.parallel_config  # type: ignore[attr-defined]
    heads = model_config.get_num_kv_heads(parallel_config)
    head_dim = model_config.get_head_size()
    first_name, first = next(iter(kv_caches.items()))
    shape = tuple(first.shape)
    use_mla = bool(getattr(model_config, "use_mla", False))
    if use_mla and first.dim() == 4 and shape[1] == 1 and shape[3] == head_dim:
        paged_format, block_size, heads = VLLM_CPU_MLA, shape[2], 1
    elif first.dim() == 4 and shape[1] == heads and shape[3] == 2 * head_dim:
        paged_format, block_size = VLLM_CPU, shape[2]
    elif first.dim() == 5 and shape[0] == 2 and shape[3:] == (heads, head_dim):
        paged_format, block_size = VLLM_FLASH, shape[2]
    elif first.dim() == 3 and use_mla:
        paged_format, block_size, heads, head_dim = VLLM_MLA, shape[1], 1, shape[2]
    else:
        raise LayoutError(
            f"KV cache of layer {first_name!r} has shape {shape} (dtype {first.dtype}); kvplug reads "
            f"vLLM's CPU layout [num_blocks, {heads}, block_size, {2 * head_dim}], the flash layout "
            f"[2, num_blocks, block_size, {heads}, {head_dim}], MLA [num_blocks, block_size, dim] and CPU MLA "
            f"[num_blocks, 1, block_size, dim] (MLA model: {use_mla})"
        )
    layout = KVLayout(
        format=paged_format,
        num_layers=len(kv_caches),
        block_size=block_size,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=first.dtype,
    )
    layout.check_caches(list(kv_caches.values()))
    return layout


def cpu_attention_isa(layout: KVLayout, vllm_config: object) -> str:
    """The CPU attention kernel family that packs this cache's blocks, e.g. ``vec/avx512``."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    except ImportError:  # a vLLM without the CPU attention backend
        return "unknown"
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)  # type: ignore[attr-defined]
    isa = _get_attn_isa(layout.dtype, layout.block_size, layout.head_dim, cache_dtype)
    if isa == "vec":
        isa += "/avx512" if torch.cpu._is_avx512_supported() else "/avx2"
    return str(isa)


def attention_backend_name(vllm_config: object) -> str:
    """The attention backend of the model's first attention layer, e.g. ``CPU_MLA``."""
    layers = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    for layer in layers.values():
        backend = getattr(layer, "attn_backend", None)
        if backend is not None:
            return str(backend.get_name())
    return "unknown"


def fingerprint_for(
    layout: KVLayout, vllm_config: object, *, tp_rank: int, pp_rank: int, kv_group: str = ""
) -> Fingerprint:
    """What makes this worker's KV bytes (in)compatible with another engine's.

    ``kv_group`` names a hybrid model's KV cache group (:meth:`kvplug_vllm.kv_groups.KVGroup.describe`):
    each group's chunks are keyed apart, and a chunk stored with one group of every layer is a miss."""
    model_config = vllm_config.model_config  # type: ignore[attr-defined]
    parallel_config = vllm_config.parallel_config  # type: ignore[attr-defined]
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")  # type: ignore[attr-defined]
    variant = [f"kv_cache_dtype={cache_dtype}", *weights_variant(model_config)]
    if cache_dtype != "auto":
        # A cache of another dtype than the model's (fp8) holds KV the model computed in its
        # own dtype and then cast: fp16 and bf16 models write other fp8 bytes. With "auto" the
        # cache's dtype, already in the key, is the model's.
        variant.append(f"model_dtype={dtype_name(model_config.dtype)}")
    if layout.format == VLLM_CPU:
        variant.append(f"cpu_attn={cpu_attention_isa(layout, vllm_config)}")
    elif layout.format == VLLM_CPU_MLA:
        variant.append(f"mla_attn={attention_backend_name(vllm_config)}")
    if kv_group:
        variant.append(kv_group)
    return Fingerprint.for_layout(
        layout,
        model_id=str(model_config.model),
        model_revision=loaded_revision(model_config),
        engine_variant="+".join(variant),
        tp_rank=tp_rank,
        tp_size=parallel_config.tensor_parallel_size,
        pp_rank=pp_rank,
        pp_size=parallel_config.pipeline_parallel_size,
    )


def loaded_revision(model_config: object) -> str:
    """The commit of the checkpoint vLLM loaded: a hub revision (``main`` too, when none was
    asked for) resolved to its commit hash, as vLLM resolved it (huggingface_hub's
    ``ResolvedRevision``, whose text is the name asked for: two servers started before and
    after a push to ``main`` loaded other weights); else the revision as given, or ``""``."""
    revision = getattr(model_config, "revision", None)
    return str(getattr(revision, "resolved", None) or revision or "")


def weights_variant(model_config: object) -> list[str]:
    """What makes one checkpoint (model id and revision) compute other KV in this engine: its
    weights quantized by a method (``--quantization fp8``: other weights, other K and V) and
    its config overridden (``--hf-overrides``, e.g. ``rope_theta``: other rotated keys). Empty
    for neither, so the keys of a plain checkpoint stay as they were."""
    parts = []
    quantization = getattr(model_config, "quantization", None)
    if quantization:
        parts.append(f"quantization={quantization}")
    if getattr(model_config, "hf_overrides", None):
        # The config as overridden (a dict or a function may override it), less what names
        # this machine's copy (its path) or the library that wrote it.
        config = json.loads(model_config.hf_config.to_json_string(use_diff=False))  # type: ignore[attr-defined]
        for local in ("_name_or_path", "transformers_version"):
            config.pop(local, None)
        canonical = json.dumps(config, sort_keys=True, separators=(",", ":"))
        parts.append(f"hf_config={hashlib.sha256(canonical.encode()).hexdigest()[:16]}")
    return parts


def head_shard(layout: KVLayout, vllm_config: object, heads_per_record: int | str, *, tp_rank: int) -> HeadShard:
    """Which of the model's KV heads this rank's cache holds, as vLLM splits them over TP
    ranks (a latent MLA cache: on every rank), and the heads per stored record."""
    model_config = vllm_config.model_config  # type: ignore[attr-defined]
    parallel_config = vllm_config.parallel_config  # type: ignore[attr-defined]
    return HeadShard.for_rank(
        total_heads=1 if layout.format.latent else int(model_config.get_total_num_kv_heads()),
        tp_rank=tp_rank,
        tp_size=int(parallel_config.tensor_parallel_size),
        heads_per_record=heads_per_record,
        latent=layout.format.latent,
    )


def check_chunk_size(layout: KVLayout, chunk_size: int) -> None:
    """A layout that copies whole blocks only needs chunks of whole blocks (``ConfigError`` if not)."""
    if layout.whole_blocks_only and chunk_size % layout.block_size:
        problem = ConfigProblem(
            "chunk_size",
            chunk_size,
            f"must be a multiple of vLLM's block size {layout.block_size}: "
            f"the {layout.format.name} layout copies whole blocks only",
        )
        raise ConfigError([problem], "kv_connector_extra_config")
