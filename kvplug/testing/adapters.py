"""LoRA adapter folders for tests of how kvplug keys an adapter (:meth:`kvplug.ExtraKey.adapter_source`)."""

from __future__ import annotations

import os
import time
from pathlib import Path


def write_lora_adapter(folder: Path, weights: bytes, *, rank: int = 8) -> Path:
    """Write a PEFT-style adapter folder (``adapter_config.json`` and ``adapter_model.safetensors``
    holding ``weights``) as vLLM and SGLang load it, dated a minute ago: past the window in which
    kvplug does not keep a digest of files just written, so a test sees one digest kept."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(f'{{"r": {rank}, "lora_alpha": 16, "target_modules": ["q_proj"]}}')
    (folder / "adapter_model.safetensors").write_bytes(weights)
    date_back(folder)
    return folder


def date_back(folder: Path) -> None:
    """Date every file of ``folder`` a minute ago (past :data:`kvplug.core.adapter_digest.RACY_NS`)."""
    past = time.time_ns() - 60 * 10**9
    for file in folder.iterdir():
        os.utime(file, ns=(past, past))
