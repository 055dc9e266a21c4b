"""vLLM's KV cache groups as kvplug serves them (its hybrid allocator, ``SupportsHMA``).

A hybrid model's layers fall into KV cache groups, each with its own block table:
full attention, sliding-window attention, Mamba/GDN recurrent state. kvplug keeps one
cache engine per group (its layers, its layout, a fingerprint naming the group), all
writing into the same tiers, and stores and loads each group with its own block ids.

- Full attention: every chunk of the prefix is stored and loaded.
- Sliding window: every chunk is stored (any chunk end can be a later hit boundary),
  but a resumed request reads only the window before its boundary; vLLM allocates
  blocks for that window only and gives the null block for the others. kvplug loads
  only the chunks that touch a real block and never writes the null block.
- Recurrent state (Mamba, Gated DeltaNet: vLLM's ``MambaSpec`` with ``mamba_cache_mode:
  align``): a layer keeps one state per request, not KV per token. In ``align`` mode vLLM
  keeps the state at block boundaries in blocks of their own and hands each one to the
  connector with its exact block id (``boundary_state_offloads``). kvplug stores the state
  at each chunk end it is handed, as that chunk's record of the state group; a hit must
  end at a chunk whose state is stored (:mod:`kvplug_vllm.state_groups`), and the load
  writes that one state into the block vLLM reads it from.
- Anything else (Mamba state in another cache mode, chunked local attention, ...) is
  refused at start-up by :func:`check_kv_cache_groups` with a message naming the model,
  the group kind and the reason; so is context parallelism (:func:`check_context_parallel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvplug.errors import LayoutError, UnsupportedModelError

#: vLLM's null block: the id a sliding-window group's table holds for blocks out of the window.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: its layers, and what kvplug stores for it."""

    index: int
    layer_names: tuple[str, ...]
    #: ``full``, ``sliding`` or ``state`` (Mamba/GDN recurrent state, vLLM's ``align`` mode).
    kind: str
    spec_name: str
    sliding_window: int | None = None
    #: A state group's state tensors (kind, shapes, dtypes) as they go into its key fingerprint:
    #: a state page is only meaningful to a kernel that lays it out the same way.
    state_format: str = ""
    #: Tokens per block in vLLM's block tables (its KV cache manager); 0: not known.
    block_size: int = 0

    def describe(self, count: int) -> str:
        """The group as it goes into the key fingerprint: index, count and kind."""
        window = f"{self.sliding_window}" if self.sliding_window else ""
        return f"kv_group={self.index}/{count}:{self.kind}{window}"


def kv_groups(kv_cache_config: Any) -> list[KVGroup]:
    """The groups of vLLM's KV cache config (checked by :func:`check_kv_cache_groups` first)."""
    groups = []
    for index, group in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = group.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        kind = "state" if _is_state(spec) else "sliding" if window else "full"
        state = _state_format(spec) if kind == "state" else ""
        block_size = int(getattr(spec, "block_size", 0) or 0)
        groups.append(KVGroup(index, tuple(group.layer_names), kind, type(spec).__name__, window, state, block_size))
    return groups


def check_block_size(group: KVGroup, cache_block_size: int) -> None:
    """Refuse a group whose caches are laid out in other blocks than the block ids vLLM hands out.

    vLLM splits each of its blocks into several of the attention kernel's when the backend
    does not take the block size as is (``kernel_block_size``, e.g. FlashInfer and
    ``--block-size 128``): a block id from the scheduler then names another place in the
    cache tensor than kvplug's slots would, and loads and stores would move other KV.
    """
    if group.block_size and group.block_size != cache_block_size:
        raise LayoutError(
            f"KV cache group {group.index} ({group.spec_name}): vLLM's block tables hold blocks of "
            f"{group.block_size} tokens, but its attention backend's cache is laid out in blocks of "
            f"{cache_block_size} (vLLM splits each block for that backend); kvplug addresses the cache by "
            f"vLLM's block ids and would copy the wrong slots. Start vLLM with --block-size {cache_block_size}, "
            "or with an attention backend that takes its block size as is"
        )


def _state_format(spec: Any) -> str:
    mamba_type = getattr(spec, "mamba_type", "")
    shapes = ",".join("x".join(str(n) for n in shape) for shape in getattr(spec, "shapes", ()))
    dtypes = ",".join(str(d).removeprefix("torch.") for d in getattr(spec, "dtypes", ()))
    return f"{str(getattr(mamba_type, 'name', mamba_type)).lower()}[{shapes}][{dtypes}]"


def _is_state(spec: Any) -> bool:
    return "mamba" in type(spec).__name__.lower()


def primary_group(groups: list[KVGroup]) -> int:
    """The group whose chunks answer lookups: the first full-attention one (it needs every chunk),
    else the first of token KV."""
    return next((g.index for g in groups if g.kind == "full"), next((g.index for g in groups if g.kind != "state"), 0))


def _refusal(spec: Any, several: bool) -> str | None:
    """Why kvplug cannot serve a group of this spec, or None."""
    if _is_state(spec):
        mode = getattr(spec, "mamba_cache_mode", None)
        if mode != "align":
            return (
                f"it holds recurrent (Mamba/GDN linear-attention) state, and vLLM keeps it in mamba_cache_mode "
                f"{mode!r}: kvplug stores the state at chunk boundaries only in mode 'align' (start vLLM with "
                "--enable-prefix-caching --mamba-cache-mode align), where vLLM keeps one state per block boundary"
            )
        if not several:
            return "a model of recurrent layers only has no attention KV for kvplug's chunks to key a hit by"
        return None
    if not hasattr(spec, "num_kv_heads"):
        return "it holds neither per-token attention KV nor a recurrent state kvplug knows"
    if not several:
        return None  # one group of token KV: kvplug's original path (sliding windows included)
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    if type(spec) in (FullAttentionSpec, SlidingWindowSpec):
        return None
    return (
        "kvplug stores the full-attention and sliding-window groups of a hybrid KV cache only; "
        "the blocks of this kind could not be keyed or loaded correctly"
    )


def check_kv_cache_groups(vllm_config: Any, kv_cache_config: Any) -> list[KVGroup]:
    """Refuse a KV cache kvplug cannot key or load correctly, naming the model, group kind and reason.

    Runs when vLLM creates the connector (scheduler and workers), which is the first
    place the KV cache specs are visible to kvplug, before vLLM runs a request.
    """
    raw = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    model = getattr(vllm_config.model_config, "model", "?")
    check_context_parallel(vllm_config, model)
    for index, group in enumerate(raw):
        reason = _refusal(group.kv_cache_spec, len(raw) > 1)
        if reason is not None:
            kinds = ", ".join(type(g.kv_cache_spec).__name__ for g in raw)
            raise UnsupportedModelError(
                f"KVPlugConnector cannot serve model {model!r}: KV cache group {index} of {len(raw)} ({kinds}) is "
                f"a {type(group.kv_cache_spec).__name__} group: {reason}. Run this model without --kv-transfer-config KVPlugConnector."
            )
    return kv_groups(kv_cache_config)


def check_context_parallel(vllm_config: Any, model: str) -> None:
    """Refuse context parallelism: it splits each request's tokens over ranks (a scheduler's
    block spans one block of each decode-context-parallel rank, holding every ``dcp``-th token),
    while kvplug stores and loads a rank's blocks as holding every token of its heads; it would
    key and load another rank's tokens (an MLA latent written by rank 0 alone) as this one's."""
    parallel = getattr(vllm_config, "parallel_config", None)
    sizes = {
        name: int(getattr(parallel, name, 1) or 1)
        for name in ("decode_context_parallel_size", "prefill_context_parallel_size")
    }
    split = ", ".join(f"{name}={size}" for name, size in sizes.items() if size > 1)
    if split:
        raise UnsupportedModelError(
            f"KVPlugConnector cannot serve model {model!r} with {split}: context parallelism splits each "
            "request's tokens over ranks, and kvplug keys and loads a rank's cache blocks as holding every token "
            "of its heads. Run without context parallelism, or without --kv-transfer-config KVPlugConnector."
        )


def first_stored_token(save_start: int, block_ids: list[int], block_size: int, chunk_size: int) -> int:
    """Where a store of a group's blocks starts: at ``save_start``, and past every chunk that
    holds a token of a leading null block (a sliding window's): the engine gathers a chunk
    that straddles its mask's start whole, so such a chunk would keep the null block's
    bytes as those tokens' KV, for a later request whose window reaches them to load."""
    real = first_real_token(block_ids, block_size)
    return max(save_start, -(-real // chunk_size) * chunk_size)


def first_real_token(block_ids: list[int], block_size: int) -> int:
    """The first token whose block is allocated: a sliding-window group's table starts with
    null blocks for the tokens out of the window (none in a full-attention group)."""
    skipped = 0
    while skipped < len(block_ids) and block_ids[skipped] == NULL_BLOCK_ID:
        skipped += 1
    return skipped * block_size
