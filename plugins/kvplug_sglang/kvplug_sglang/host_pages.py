"""Pages of SGLang HiCache host pools, seen in one canonical order.

A host pool (``MHATokenToKVPoolHost``, ``MLATokenToKVPoolHost``) keeps a page of
``page_size`` tokens in the order of its ``--hicache-mem-layout``. kvplug stores
every page as ``[num_kv, num_layers, page_size, num_heads, head_dim]`` (``num_kv``
2 for K/V, 1 for MLA's latent cache), so a cache written by a server with one
layout is read by a server with another.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvplug.errors import LayoutError

#: layouts whose pages this module can map; others are refused at registration.
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class HostPageFormat:
    """How one host pool's page maps to the canonical page."""

    layout: str
    is_mla: bool
    num_layers: int
    page_size: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    page_shape: tuple[int, ...]  # ``get_data_page(i, flat=False).shape``
    #: Host indices SGLang hands over per page: ``page_size`` times the DCP size, whose
    #: ranks each hold ``page_size`` of a page's tokens (SGLang's ``logical_page_size``).
    indices_per_page: int
    #: The model layer of the pool's first (a pipeline stage's pool holds a slice of them).
    first_layer: int = 0

    @classmethod
    def of(cls, host: Any) -> HostPageFormat:
        layout = getattr(host, "layout", None)
        is_mla = not hasattr(host, "v_buffer")
        allowed = MLA_LAYOUTS if is_mla else MHA_LAYOUTS
        kind = "MLA" if is_mla else "MHA"
        if not isinstance(layout, str) or layout not in allowed:
            raise LayoutError(
                f"kvplug's HiCache backend supports {kind} host pools with --hicache-mem-layout "
                f"{', '.join(allowed)}; got {layout!r} ({type(host).__name__})"
            )
        page_size = int(host.page_size)
        page_shape = tuple(host.get_data_page(0, flat=False).shape)
        return cls(
            layout=layout,
            is_mla=is_mla,
            num_layers=int(host.layer_num),
            page_size=page_size,
            num_heads=int(getattr(host, "head_num", 1)),
            head_dim=int(host.kv_buffer.shape[-1]),
            dtype=host.dtype,
            page_shape=page_shape,
            indices_per_page=int(getattr(host, "logical_page_size", page_size)),
            first_layer=int(getattr(host, "start_layer", 0) or 0),
        )

    @property
    def canonical_shape(self) -> tuple[int, int, int, int, int]:
        num_kv = 1 if self.is_mla else 2
        return (num_kv, self.num_layers, self.page_size, self.num_heads, self.head_dim)

    def describe(self) -> str:
        """Layout text for the fingerprint (the canonical page, not the host layout). Two
        pipeline stages of as many layers each (of two layer partitions) hold other layers:
        a pool that starts past layer 0 names its first."""
        kind = "mla" if self.is_mla else "mha"
        layers = f"L{self.num_layers}" + (f"@{self.first_layer}" if self.first_layer else "")
        return f"sglang_hicache_{kind}:{layers}:P{self.page_size}:H{self.num_heads}:D{self.head_dim}"

    def canonical(self, page: torch.Tensor) -> torch.Tensor:
        """A view of ``page`` (shaped like the host's pages, or flat) in canonical order."""
        page = page.view(self.page_shape)
        if self.is_mla:
            if self.layout == "layer_first":  # [L, ps, H, D]
                return page.unsqueeze(0)
            if self.layout == "page_first":  # [ps, L, H, D]
                return page.permute(1, 0, 2, 3).unsqueeze(0)
            return page  # page_first_direct: [1, L, ps, H, D]
        if self.layout == "layer_first":  # [2, L, ps, H, D]
            return page
        if self.layout == "page_first":  # [2, ps, L, H, D]
            return page.permute(0, 2, 1, 3, 4)
        if self.layout == "page_first_direct":  # [2, 1, L, ps, H, D]
            return page[:, 0]
        return page[:, 0].permute(0, 3, 2, 1, 4)  # page_head: [2, 1, H, ps, L, D]
