"""A generic description of a paged KV cache, declared by the engine adapter that owns it.

An engine adapter declares how one layer's cache is laid out in memory as a
:class:`PagedFormat` (which axes, in which memory order, K and V in one tensor or
two); a :class:`KVLayout` adds the sizes. The core knows no engine: every format
maps to the same chunk tensor ``[num_layers, num_kv, num_tokens, token_width]``
(``num_kv`` is 2 for K and V, 1 for a latent cache; ``token_width`` is heads * head_dim),
and a connector addresses any format through :meth:`KVLayout.kv_views`. Packed
(``whole_blocks_only``) formats fill that tensor in block order instead
(:meth:`KVLayout.packed_block_split`).

Slots address tokens: ``slot = block_id * block_size + offset_in_block``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplug.core.chunk_format import dtype_name
from kvplug.core.lazy_module import LazyModule
from kvplug.errors import LayoutError

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Axis names a format may use. ``kv``: K (0) and V (1); ``block``/``token``: the page
#: and the token inside it; ``slot``: block * block_size + token merged, for pools
#: addressed by token; ``head``: KV head; ``dim``: element of a head.
AXES: tuple[str, ...] = ("kv", "block", "token", "slot", "head", "dim")


#: Fingerprint suffix of packed (whole_blocks_only) layouts: chunks in block order.
PACKED_FRAME_ORDER = ":block_order"


@dataclass(frozen=True)
class PagedFormat:
    """How an engine lays out ONE layer's paged KV cache in memory; declared by its adapter.

    ``axes`` lists the per-layer tensor's axes in memory order (outermost first). The
    sizes come from the :class:`KVLayout`: ``kv`` is 2, ``token`` is ``block_size``,
    ``head`` is ``num_kv_heads``, ``dim`` is ``head_dim``; ``block`` and ``slot`` are as
    large as the engine allocated.
    """

    #: Stable text in the key fingerprint, e.g. ``"myengine_paged"``: renaming it orphans stored chunks.
    name: str
    #: Memory order of the per-layer tensor's axes, names from :data:`AXES`.
    axes: tuple[str, ...]
    #: 2: K and V are separate tensors per layer (then no ``kv`` axis).
    tensors: int = 1
    #: One K/V-less latent cache per token (MLA): num_kv is 1, no ``kv`` axis, one head.
    latent: bool = False
    #: Bytes inside a block are packed engine-privately: only whole blocks are copied,
    #: and the tensor may be declared with another shape of the same size per block.
    whole_blocks_only: bool = False
    #: The engine's tensor shape, for error messages.
    shape_doc: str = ""

    def __post_init__(self) -> None:
        axes = tuple(self.axes)
        object.__setattr__(self, "axes", axes)
        where = f"paged format {self.name!r} with axes {axes}"
        if not self.name or not isinstance(self.name, str):
            raise LayoutError(f"{where}: the name must be non-empty text (it goes into the key fingerprint)")
        unknown = [axis for axis in axes if axis not in AXES]
        if unknown:
            raise LayoutError(f"{where}: unknown axis {unknown[0]!r}; axes are {', '.join(AXES)}")
        if len(set(axes)) != len(axes):
            raise LayoutError(f"{where}: an axis appears twice")
        if "dim" not in axes:
            raise LayoutError(f"{where}: the 'dim' axis (head_dim) is missing")
        if "slot" in axes and ("block" in axes or "token" in axes):
            raise LayoutError(f"{where}: 'slot' merges 'block' and 'token'; use either slot or both of those")
        if "slot" not in axes and not ("block" in axes and "token" in axes):
            raise LayoutError(f"{where}: a paged cache needs 'block' and 'token' axes, or one 'slot' axis")
        if self.tensors not in (1, 2):
            raise LayoutError(f"{where}: tensors is 1 (K and V in one tensor) or 2 (K and V apart), got {self.tensors}")
        if "kv" in axes and (self.tensors == 2 or self.latent):
            why = "K and V are separate tensors" if self.tensors == 2 else "a latent cache has no K/V split"
            raise LayoutError(f"{where}: a 'kv' axis is wrong when {why}")
        if self.latent and self.tensors != 1:
            raise LayoutError(f"{where}: a latent cache is one tensor per layer")
        if not self.latent and self.tensors == 1 and "kv" not in axes:
            raise LayoutError(f"{where}: K and V in one tensor need a 'kv' axis (or tensors=2, or latent=True)")
        if self.whole_blocks_only and axes[0] != "block":  # axes hold 'dim' at least: checked above
            raise LayoutError(
                f"{where}: whole_blocks_only copies each block as one run: 'block' must be the first axis"
            )

    @property
    def num_kv(self) -> int:
        """Tensors per token in the chunk: 2 (K and V), 1 for a latent cache."""
        return 1 if self.latent else 2

    @property
    def token_addressed(self) -> bool:
        """Whether pages are single slots (a ``slot`` axis) rather than blocks of tokens."""
        return "slot" in self.axes

    def describe_shape(self) -> str:
        return self.shape_doc or ("(K, V), each " if self.tensors == 2 else "") + "[" + ", ".join(self.axes) + "]"


@dataclass(frozen=True)
class KVLayout:
    """Shape facts of an engine's KV cache, shared by connector and fingerprint."""

    format: PagedFormat
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.format, PagedFormat):
            raise LayoutError(
                f"KVLayout takes a kvplug.PagedFormat that the engine adapter declares, got {self.format!r} "
                "(KVLayout.kind became KVLayout.format in kvplug 0.2)"
            )
        for field_name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, field_name) <= 0:
                raise LayoutError(f"{field_name} must be positive, got {getattr(self, field_name)}")
        if (self.format.latent or "head" not in self.format.axes) and self.num_kv_heads != 1:
            what = "a latent cache" if self.format.latent else "a format without a 'head' axis"
            raise LayoutError(f"{self.format.name} is {what}, one head: num_kv_heads must be 1")

    @property
    def num_kv(self) -> int:
        return self.format.num_kv

    @property
    def whole_blocks_only(self) -> bool:
        """Whether the layout packs tokens inside a block in an engine-private way,
        so that only whole blocks may be gathered or scattered."""
        return self.format.whole_blocks_only

    @property
    def page_tokens(self) -> int:
        """Tokens per page of :meth:`kv_views`: the block size, or 1 for token-addressed formats."""
        return 1 if self.format.token_addressed else self.block_size

    @property
    def token_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def chunk_shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv, num_tokens, self.token_width)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """The declared shape of one of a layer's cache tensors holding ``num_blocks`` blocks
        (``num_blocks * block_size`` slots for token-addressed formats), axes in the format's order."""
        sizes = {**self._fixed_axis_sizes(), "block": num_blocks, "slot": num_blocks * self.block_size}
        return tuple(sizes[axis] for axis in self.format.axes)

    def _fixed_axis_sizes(self) -> dict[str, int]:
        """The sizes of the axes that do not depend on how many blocks a cache holds."""
        return {"kv": 2, "token": self.block_size, "head": self.num_kv_heads, "dim": self.head_dim}

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * self.num_kv * self.token_width * itemsize

    def describe(self) -> str:
        """Stable text for the key fingerprint."""
        text = (
            f"{self.format.name}:L{self.num_layers}:B{self.block_size}:H{self.num_kv_heads}:"
            f"D{self.head_dim}:{dtype_name(self.dtype)}"
        )
        # The suffix names the block order of packed formats' chunks (packed_block_split):
        # chunks written in another order have another fingerprint, so they are misses.
        return text + PACKED_FRAME_ORDER if self.format.whole_blocks_only else text

    def packed_block_split(self) -> tuple[int, int, int]:
        """A block of one layer tensor of a packed format as ``(outer, kv, inner)`` elements.

        The chunk of a ``whole_blocks_only`` format holds each block as the engine stores
        it, split by K/V index only: with one block of a layer tensor viewed as
        ``[outer, kv, inner]`` (``kv`` 2 when the tensor holds K and V, else 1),
        ``chunk[layer, i, b * block_size:(b + 1) * block_size]`` is ``block[:, i, :]`` of
        the ``b``-th block copied, in memory order. The engine packs tokens privately, so
        no token order is implied, and the copies run over whole ``inner`` runs (e.g. a
        head's K or V half of a block) instead of single head rows.
        """
        if not self.format.whole_blocks_only:
            raise LayoutError(f"{self.format.name} is not a packed (whole_blocks_only) format")
        fixed = self._fixed_axis_sizes()
        axes = self.format.axes[1:]  # 'block' is first in a packed format
        if "kv" not in axes:
            return 1, 1, math.prod(fixed[a] for a in axes)
        at = axes.index("kv")
        return math.prod(fixed[a] for a in axes[:at]), 2, math.prod(fixed[a] for a in axes[at + 1 :])

    def layer_tensors(self, layer_cache: object) -> tuple[torch.Tensor, ...]:
        """The tensor(s) of one layer's cache: ``format.tensors`` of them."""
        if isinstance(layer_cache, torch.Tensor) and self.format.tensors == 1:  # every copy asks: the short way
            return (layer_cache,)
        tensors = tuple(layer_cache) if isinstance(layer_cache, (tuple, list)) else (layer_cache,)
        if len(tensors) != self.format.tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
            raise LayoutError(
                f"a {self.format.name} layer cache is {self.format.tensors} tensor(s) "
                f"{self.format.describe_shape()}, got {_what(layer_cache)}"
            )
        return tensors

    def kv_views(self, layer_cache: object) -> tuple[torch.Tensor, ...]:
        """One strided view per K/V index (``num_kv`` of them), ``[pages, page_tokens, num_kv_heads, head_dim]``.

        Views only, no copies: writing into them writes the engine's cache. Pages are
        blocks of ``block_size`` tokens, or single slots (``page_tokens`` 1) for
        token-addressed formats; a format without a ``head`` axis has one head. Axes
        a format lacks get stride 0. For whole_blocks_only formats the views follow
        the declared memory order, which is meaningful for whole blocks only.
        """
        views = []
        for tensor in self.layer_tensors(layer_cache):
            found = self._axis_sizes(tensor)
            if found is None:
                raise LayoutError(self._misfit(tensor))
            size = dict(zip(self.format.axes, found[0]))
            stride = dict(zip(self.format.axes, found[1]))
            if self.format.token_addressed:
                pages, tokens = size["slot"], 1
                page_stride, token_stride = stride["slot"], 0
            else:
                pages, tokens = size["block"], size["token"]
                page_stride, token_stride = stride["block"], stride["token"]
            shape = (pages, tokens, size.get("head", 1), self.head_dim)
            strides = (page_stride, token_stride, stride.get("head", 0), stride["dim"])
            origin = tensor.storage_offset()
            for index in range(size.get("kv", 1)):
                views.append(tensor.as_strided(shape, strides, origin + index * stride.get("kv", 0)))
        return tuple(views)

    def check_caches(self, kv_caches: Sequence[object]) -> None:
        """Raise ``LayoutError`` naming the first layer whose tensors do not fit."""
        if len(kv_caches) != self.num_layers:
            raise LayoutError(f"expected {self.num_layers} layer caches, got {len(kv_caches)}")
        for index, cache in enumerate(kv_caches):
            try:
                tensors = self.layer_tensors(cache)
            except LayoutError as exc:
                raise LayoutError(f"layer {index}: {exc}") from None
            for tensor in tensors:
                if tensor.dtype != self.dtype:
                    raise LayoutError(
                        f"layer {index}: expected {self.dtype} tensors shaped {self.format.describe_shape()} "
                        f"({self.format.name}), got {tensor.dtype}"
                    )
                if self._axis_sizes(tensor) is None:
                    raise LayoutError(f"layer {index}: {self._misfit(tensor)}")

    def check_call(
        self, num_tokens: int, kv_caches: Sequence[object], slots: torch.Tensor, mask: torch.Tensor | None
    ) -> int:
        """Check a store or retrieve call's arguments (``LayoutError`` naming what is wrong);
        returns the index of the first token ``mask`` selects."""
        self.check_caches(kv_caches)
        if slots.dim() != 1 or slots.numel() != num_tokens:
            raise LayoutError(
                f"slots must be 1-D with one entry per token ({num_tokens}), got shape {tuple(slots.shape)}"
            )
        if mask is None:
            return 0
        if mask.dim() != 1 or mask.numel() != num_tokens or mask.dtype != torch.bool:
            raise LayoutError(
                f"mask must be a 1-D bool tensor of {num_tokens} entries, got {mask.dtype} {tuple(mask.shape)}"
            )
        first = int(torch.count_nonzero(~mask))
        if not bool(mask[first:].all()):
            raise LayoutError("mask must be False for a prefix of the tokens and True after it")
        return first

    def _axis_sizes(self, tensor: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """Sizes and strides of ``tensor`` along the format's axes, or None when it does not fit.

        A tensor fits when its shape is the axis sizes (any strides), or, for packed
        (whole_blocks_only) formats, when it is contiguous with the same number of
        elements per block: the engine may declare a nominal shape of its own.
        """
        fixed = self._fixed_axis_sizes()
        axes = self.format.axes
        shape = tuple(tensor.shape)
        if len(shape) == len(axes) and all(shape[i] == fixed[a] for i, a in enumerate(axes) if a in fixed):
            return shape, tuple(tensor.stride())
        if self.format.whole_blocks_only and tensor.dim() > 0 and tensor.is_contiguous():
            per_block = math.prod(fixed[a] for a in axes[1:])
            if tensor.numel() == shape[0] * per_block:
                sizes = (shape[0], *(fixed[a] for a in axes[1:]))
                return sizes, _dense_strides(sizes)
        return None

    def _misfit(self, tensor: torch.Tensor) -> str:
        packed = " (or contiguous, same elements per block)" if self.format.whole_blocks_only else ""
        return (
            f"shape {tuple(tensor.shape)} does not match {self.format.name} {self.format.describe_shape()}{packed} "
            f"with block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"
        )


def _dense_strides(sizes: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``sizes``."""
    return tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))


def _what(cache: object) -> str:
    if isinstance(cache, (tuple, list)):
        return f"a {type(cache).__name__} of {len(cache)}"
    return type(cache).__name__


def slots_from_block_ids(
    block_ids: Sequence[int] | torch.Tensor,
    block_size: int,
    num_tokens: int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The slot mapping of the first ``num_tokens`` tokens of a block table row."""
    blocks = torch.as_tensor(block_ids, dtype=torch.long, device=device)
    needed = -(-num_tokens // block_size)
    if blocks.numel() < needed:
        raise LayoutError(f"{num_tokens} tokens need {needed} blocks, got {blocks.numel()}")
    offsets = torch.arange(block_size, dtype=torch.long, device=blocks.device)
    slots = (blocks[:needed, None] * block_size + offsets).reshape(-1)
    return slots[:num_tokens]
