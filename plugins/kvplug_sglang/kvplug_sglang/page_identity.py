"""What a HiCache page's key names besides SGLang's own page hash: the checkpoint the server
loaded, its KV cache variant (an fp8 format and its scales), the weights it runs the checkpoint
with (quantized, config overridden) and its attention-CP shard. The radix-cache backend's
chunk keys name the KV cache variant and the weights too (:mod:`kvplug_sglang.setup_engine`).

Each tells apart pages whose bytes differ where SGLang's hash and the host pool's shape
agree; a page read under another's key would be loaded as this server's KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kvplug

if TYPE_CHECKING:  # a type only: the radix-cache backend imports this module too
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

logger = logging.getLogger("kvplug.sglang.hicache")


def cp_shard(cfg: HiCacheStorageConfig) -> str:
    """The attention-CP shard a rank's pages are, for its keys (``""`` without CP). Under
    attention DP SGLang hands every CP peer the same ``tp_rank`` (its attention-TP rank), and
    CP ranks may hold different slices of a page (NSA context parallel): SGLang's own file
    backend keys each CP rank apart too. A peer that reads another's slice would load wrong KV."""
    return f":cp{cfg.attn_cp_rank}/{cfg.attn_cp_size}" if cfg.attn_cp_size > 1 else ""


def kv_cache_variant() -> str:
    """The KV cache dtype this SGLang server was told and the KV scales it loaded, where set.
    SGLang keeps an fp8 KV cache in uint8 pages (e4m3 and e5m2 alike), so the pages' dtype does
    not tell them apart; the scales (``--quantization-param-path``) change the bytes too, and so
    does the model's ``--dtype`` (the KV it computes in it is cast: float16 and bfloat16 give
    other fp8 bytes; with an ``auto`` cache the pages' dtype is the model's)."""
    model = _published_model()
    if model is None:
        return ""
    kv_cache_dtype = str(getattr(model, "kv_cache_dtype", None) or "auto")
    model_dtype = str(getattr(model, "dtype", None) or "auto")
    scales = str(getattr(model, "quantization_param_path", None) or "")
    return ("" if kv_cache_dtype == "auto" else f";kv_cache_dtype={kv_cache_dtype};model_dtype={model_dtype}") + (
        f";kv_scales={_scales_digest(scales)}" if scales else ""
    )


def weights_variant() -> str:
    """How this SGLang server runs its checkpoint where that changes the KV it computes: weights
    quantized by a method (``--quantization fp8``) and the model config overridden
    (``--json-model-override-args``, e.g. ``rope_theta``: other rotated keys). Either changes
    every page's bytes under one model path and revision; ``""`` for neither."""
    model = _published_model()
    if model is None:
        return ""
    quantization = str(getattr(model, "quantization", None) or "")
    overrides = str(getattr(model, "json_model_override_args", None) or "{}")
    try:
        parsed: Any = json.loads(overrides)
    except ValueError:  # SGLang refuses it when it starts: keyed by the text as given
        parsed = overrides
    canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"))
    return (f";quantization={quantization}" if quantization else "") + (
        f";overrides={hashlib.sha256(canonical.encode()).hexdigest()[:16]}" if parsed != {} else ""
    )


def _scales_digest(path: str) -> str:
    """The digest of the KV scales file at ``path``: SGLang scales by what the file says when it
    loads, not by its name (one path may hold other scales on another machine or after a rewrite;
    one file may be copied to two paths). A file that cannot be read is this process's alone:
    SGLang fell back to its default scales then, or read it before it went; which, nothing says."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as exc:
        logger.warning(
            "KVPlugStorage: the KV scales file %r cannot be read (%s); no other server will read this one's pages",
            path,
            exc,
        )
        return f"unreadable-{os.urandom(16).hex()}"


def loaded_checkpoint() -> tuple[str, str]:
    """The model path and revision this SGLang server loaded (:func:`loaded_revision`); empty
    outside a server (SGLang has published no model config: a backend built by hand)."""
    model = _published_model()
    if model is None:
        return "", ""
    path = str(getattr(model, "model_path", None) or "")
    return path, loaded_revision(path, getattr(model, "revision", None))


#: ``(model path, revision asked for) -> commit`` of each hub checkpoint this process downloaded
#: or found in the HF cache (:func:`record_download`).
_LOADED_COMMITS: dict[tuple[str, str], str] = {}
#: A hub cache's snapshot folder, ``.../snapshots/<commit>``.
_SNAPSHOT = re.compile(r"(?:^|[/\\])snapshots[/\\]([0-9a-f]{40})[/\\]?$")


def record_download(
    folder: Any,
    model_name_or_path: Any,
    cache_dir: Any = None,
    allow_patterns: Any = None,
    revision: Any = None,
    *_: Any,
    **__: Any,
) -> None:
    """After SGLang's ``download_weights_from_hf`` (an ``AFTER`` hook: :mod:`kvplug_sglang.plugin`):
    remember the commit of the snapshot folder it returned, the one this process loads weights
    from. SGLang keeps that folder nowhere else, and its model config names the revision as asked
    for (``None``: ``main``); reading the HF cache's ``refs/`` later would race a download of a
    newer commit that landed since. Never raises: it runs inside SGLang's model loading."""
    match = _SNAPSHOT.search(str(folder))
    if match is not None:
        _LOADED_COMMITS[(str(model_name_or_path), str(revision or ""))] = match[1]


def loaded_revision(model_path: str, revision: Any) -> str:
    """The commit this process loaded ``model_path`` at, as asked for by ``revision`` (``main``
    when none was); else the revision as given (a local directory, or weights SGLang did not
    load through its hub download). Two servers started before and after a push to ``main``
    loaded other weights: keyed by the name alone they shared pages and chunks."""
    asked = str(revision or "")
    return _LOADED_COMMITS.get((model_path, asked), asked)


#: This process's weights generation: ``""`` until SGLang updates its weights in place, then a
#: new hex digest per update (:func:`note_weight_update`).
_weights_generation = ""


def weights_generation() -> str:
    """The weights this process serves, as far as in-place updates changed them since it
    started: ``""`` for the weights it loaded at start (keyed by model path and revision)."""
    return _weights_generation


def weights_keys() -> tuple[kvplug.ExtraKey, ...]:
    """The extra key of a request's chunks that names :func:`weights_generation` (none before an
    in-place update). It covers the first token: the chained hash carries it into every chunk."""
    generation = _weights_generation
    return (kvplug.ExtraKey(0, 1, "weights:" + generation),) if generation else ()


def note_weight_update(manager: Any, recv_req: Any, *_: Any, **__: Any) -> None:
    """Before SGLang's scheduler updates its weights in place (a ``BEFORE`` hook on each of
    ``update_weights_from_{disk,tensor,distributed,ipc}``: :mod:`kvplug_sglang.plugin`): a new
    generation, so chunks of the old weights are misses, never served for the new ones.

    Bumped before the update, whether it succeeds or not: a failed one may have loaded part of
    the weights, and a needless bump costs only misses. A checkpoint from disk is named by its
    path, load format and weight version, chained to the generation before it: every TP rank
    (and every server updated from the same paths in the same order) computes the same key,
    and a path rewritten between two updates is a new link. Weights sent as tensors (through
    memory, NCCL or IPC) are named by nothing kvplug can check (a ``weight_version`` is the
    caller's step number, which another job reuses for other weights): a random generation,
    this process's own. Never raises: it runs inside SGLang's request handling."""
    global _weights_generation
    try:
        source = getattr(recv_req, "model_path", None)
        if isinstance(source, str) and source:
            link = ["disk", source, str(getattr(recv_req, "load_format", None) or "")]
            link.append(str(getattr(recv_req, "weight_version", None) or ""))
        else:
            link = ["unnamed", os.urandom(16).hex()]
        chained = json.dumps([_weights_generation, *link], separators=(",", ":"))
        _weights_generation = hashlib.sha256(chained.encode()).hexdigest()[:32]
    except Exception:  # never fail SGLang's update; without a name the old chunks must still go
        _weights_generation = os.urandom(16).hex()
        logger.exception("kvplug: a weight update was not named; this process's chunks from now on are its own")


def _published_model() -> Any:
    """The model config this SGLang server published; ``None`` outside a server (a backend built by hand)."""
    from sglang.srt.runtime_context import get_model

    try:
        return get_model()
    except ValueError:  # "config namespace 'model' not published"
        return None
