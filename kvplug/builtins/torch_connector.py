"""KV connector ``torch``: gather/scatter with plain torch indexing, on any device.

It is the reference every faster connector (kvplug-cuda's kernels) is checked
against, so it favours obvious correctness. Four things keep it near memcpy speed
on contiguous caches: slots that cover whole blocks in order (the usual case:
chunks are block-aligned) are copied a block at a time; each layer (K and V
together) takes one ``index_select``/``index_copy_`` straight into its
destination; on the CPU those run on the widest integer word the rows allow,
because torch's CPU index kernels copy bf16, fp16 and fp8 element by element;
and long runs of consecutive slots or blocks are copied as slices
(:mod:`kvplug.builtins.index_runs`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import BaseModel

from kvplug.builtins.chunk_checks import check_chunk_layer, check_chunks
from kvplug.builtins.copy_routes import Route, find_route
from kvplug.builtins.index_runs import IndexRuns, SpanRuns
from kvplug.builtins.packed_blocks import PackedBlockCopies
from kvplug.builtins.row_copies import gather_rows, scatter_rows
from kvplug.core.connector import KVConnector, LayerCache
from kvplug.core.layouts import KVLayout
from kvplug.core.lazy_module import LazyModule
from kvplug.errors import LayoutError

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")


@dataclass(frozen=True)
class SlotPlan:
    """Slots of a chunk, and the blocks they fill when they fill whole blocks."""

    slots: torch.Tensor
    blocks: torch.Tensor | None
    block_offsets: tuple[torch.Tensor, torch.Tensor]
    slot_runs: IndexRuns | None = None  # runs of consecutive slots
    page_runs: IndexRuns | None = None  # runs of consecutive pages, when the slots fill whole pages


class _WholeBlockGroups:
    """Which spans of a slot tensor fill whole blocks in order, from one check of every group of ``size`` slots.

    Slots ``[start, end)`` fill whole blocks when both ends fall on a group boundary
    and every group between holds one block's slots in order. Groups are counted from
    the first slot, so a span that starts elsewhere is never taken for whole blocks.
    """

    def __init__(self, slots: torch.Tensor, size: int) -> None:
        self.size = size
        count = slots.numel() // size if size > 1 else 0
        rows = slots[: count * size].view(count, size)
        first = rows[:, :1]
        good = ((first % size) == 0).flatten() & (rows == first + torch.arange(size, device=slots.device)).all(dim=1)
        #: The block each group would fill: ``pages[g]`` for group ``g``.
        self.pages = torch.div(first.flatten(), size, rounding_mode="floor")
        # Groups failing the check before each group: a span passes when none fail inside it.
        self._bad_before: list[int] = [0, *torch.cumsum(~good, 0).tolist()]

    def whole(self, start: int, end: int) -> bool:
        size = self.size
        if size <= 1 or end <= start or start % size or end % size:
            return False
        return self._bad_before[end // size] == self._bad_before[start // size]


#: Geometries remembered per connector; an engine has one or two, tests a few more.
_MAX_ROUTES = 64


class TorchConnector(KVConnector):
    """Works for every :class:`kvplug.PagedFormat` and every device torch has.

    It addresses a layer through :meth:`kvplug.KVLayout.kv_views` and picks the
    fastest copy the views' strides allow (whole pages as rows, token rows, whole
    packed blocks through a scratch buffer, else advanced indexing). The choice
    depends on shapes and strides only, so it is made once per geometry.
    """

    name = "torch"
    concurrent_copies = True  # routes are computed idempotently; scratch buffers are per thread

    def __init__(self, config: BaseModel, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self._routes: dict[tuple[object, ...], Route] = {}
        self._page_tokens = layout.page_tokens
        self._packed = PackedBlockCopies(layout) if layout.whole_blocks_only else None
        self._kv_width = (layout.num_kv, layout.token_width)  # of a chunk layer, checked on every copy

    def plan(self, slots: torch.Tensor) -> SlotPlan:
        return self._plans(slots, [(0, slots.numel())])[0]

    def plan_many(self, slots: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[SlotPlan]:
        if type(self).plan is not TorchConnector.plan:  # a subclass plans its own way
            return super().plan_many(slots, spans)
        return self._plans(slots, spans)

    def _plans(self, slots: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[SlotPlan]:
        """Plans of ``slots[start:end]`` for each span, from one pass of torch ops over ``slots``."""
        size = self.layout.block_size
        slots = slots.to(torch.long)
        blocks = torch.div(slots, size, rounding_mode="floor")
        offsets = slots % size
        groups = _WholeBlockGroups(slots, size)
        # Runs of the index each copy path will use (page rows when whole pages, else token rows).
        slot_runs = SpanRuns(slots)
        page_runs = SpanRuns(groups.pages) if self._page_tokens > 1 else slot_runs
        plans = []
        for start, end in spans:
            # Groups count from slots[0]: a span that starts inside one (a load from mid-chunk) is planned alone.
            if start % size:
                plans.append(self._plans(slots[start:end], [(0, end - start)])[0])
                continue
            first_group, group_end = start // size, end // size
            blocks_only = groups.pages[first_group:group_end] if groups.whole(start, end) else None
            if self._page_tokens == 1:
                runs = (slot_runs.of(start, end),) * 2
            elif blocks_only is not None:
                runs = (None, page_runs.of(first_group, group_end))
            else:
                runs = (slot_runs.of(start, end), None)
            plans.append(SlotPlan(slots[start:end], blocks_only, (blocks[start:end], offsets[start:end]), *runs))
        return plans

    def gather_copies(
        self,
        kv_caches: Sequence[LayerCache],
        layers: range,
        plans: Sequence[SlotPlan],
        chunks: Sequence[torch.Tensor],
        parts: int,
    ) -> list[Callable[[], None]]:
        # Every chunk and layer checked before the first copy: a refused call copies nothing.
        check_chunks(self.layout, kv_caches, layers, [plan.slots.numel() for plan in plans], chunks)
        return super().gather_copies(kv_caches, layers, plans, chunks, parts)

    def scatter_copies(
        self,
        kv_caches: Sequence[LayerCache],
        layers: range,
        plans: Sequence[SlotPlan],
        chunks: Sequence[torch.Tensor],
        parts: int,
    ) -> list[Callable[[], None]]:
        check_chunks(self.layout, kv_caches, layers, [plan.slots.numel() for plan in plans], chunks)
        return super().scatter_copies(kv_caches, layers, plans, chunks, parts)

    def gather_layer(self, layer_cache: LayerCache, plan: SlotPlan, out: torch.Tensor) -> None:
        tensors = self.layout.layer_tensors(layer_cache)
        check_chunk_layer(self._kv_width, tensors, plan.slots.numel(), out)
        if self._packed is not None:
            self._packed.gather(tensors, self._whole_blocks(plan), plan.page_runs, out)
            return
        route = self._route(tensors)
        pages = self._pages(plan)
        if pages is not None and route.page_rows is not None and out.is_contiguous():
            # Whole pages: a page is one row (K and V in one call when one tensor holds both).
            if route.stacked_page_rows is not None:
                rows = route.stacked_page_rows.of(tensors)
                gather_rows(rows, pages, out.view(rows.shape[0], pages.numel(), -1), dim=1, runs=plan.page_runs)
            else:
                for index, page_rows in enumerate(route.page_rows):
                    gather_rows(page_rows.of(tensors), pages, out[index].view(pages.numel(), -1), runs=plan.page_runs)
        elif route.token_rows is not None:
            for index, token_rows in enumerate(route.token_rows):
                gather_rows(token_rows.of(tensors), plan.slots, out[index], runs=plan.slot_runs)
        else:
            page, offset = self._page_offsets(plan, tensors[0].device, route)
            if route.stacked is not None:
                out.copy_(route.stacked.of(tensors)[:, page, offset].flatten(2))  # [num_kv, n, H*D]
            else:
                for index, view in enumerate(route.views):
                    out[index].copy_(view.of(tensors)[page, offset].flatten(1))

    def scatter_layer(self, layer_cache: LayerCache, plan: SlotPlan, src: torch.Tensor) -> None:
        tensors = self.layout.layer_tensors(layer_cache)
        check_chunk_layer(self._kv_width, tensors, plan.slots.numel(), src)
        if self._packed is not None:
            self._packed.scatter(tensors, self._whole_blocks(plan), plan.page_runs, src)
            return
        route = self._route(tensors)
        device = tensors[0].device
        src = src.to(device, non_blocking=True)
        pages = self._pages(plan)
        if pages is not None and route.page_rows is not None:
            pages = pages.to(device)
            if route.stacked_page_rows is not None:
                rows = route.stacked_page_rows.of(tensors)
                scatter_rows(rows, pages, src.reshape(rows.shape[0], pages.numel(), -1), dim=1, runs=plan.page_runs)
            else:
                for index, page_rows in enumerate(route.page_rows):
                    scatter_rows(page_rows.of(tensors), pages, src[index], runs=plan.page_runs)
        elif route.token_rows is not None:
            slots = plan.slots.to(device)
            for index, token_rows in enumerate(route.token_rows):
                scatter_rows(token_rows.of(tensors), slots, src[index], runs=plan.slot_runs)
        else:
            page, offset = self._page_offsets(plan, device, route)
            heads, dim = self.layout.num_kv_heads, self.layout.head_dim
            if route.stacked is not None:
                route.stacked.of(tensors)[:, page, offset] = src.view(self.layout.num_kv, -1, heads, dim)
            else:
                for index, view in enumerate(route.views):
                    view.of(tensors)[page, offset] = src[index].view(-1, heads, dim)

    def _route(self, tensors: tuple[torch.Tensor, ...]) -> Route:
        key = tuple((t.shape, t.stride()) for t in tensors)
        route = self._routes.get(key)
        if route is None:
            route = find_route(self.layout, tensors)
            if len(self._routes) >= _MAX_ROUTES:
                self._routes.clear()
            self._routes[key] = route
        return route

    def _pages(self, plan: SlotPlan) -> torch.Tensor | None:
        """The pages the slots fill, when they fill whole pages in order (slots are pages of one)."""
        return plan.slots if self._page_tokens == 1 else plan.blocks

    def _page_offsets(self, plan: SlotPlan, device: torch.device, route: Route) -> tuple[torch.Tensor, torch.Tensor]:
        """The page and the token in it of each planned slot, every one inside the cache: this
        route indexes with Python semantics, where slot -1 would be the last page's last token."""
        if plan.slots.numel():
            low, high = torch.stack(torch.aminmax(plan.slots)).tolist()
            slots = min(view.size[0] for view in route.views) * self._page_tokens
            if low < 0 or high >= slots:
                raise LayoutError(
                    f"slot {low if low < 0 else high} is outside the cache: it holds {slots} slots "
                    f"({slots // self._page_tokens} pages of {self._page_tokens})"
                )
        if self._page_tokens == 1:
            slots_on_device = plan.slots.to(device)
            return slots_on_device, torch.zeros_like(slots_on_device)
        return plan.block_offsets[0].to(device), plan.block_offsets[1].to(device)

    def _whole_blocks(self, plan: SlotPlan) -> torch.Tensor:
        """The blocks a packed layout's copy moves: only slots that fill whole blocks in order have them."""
        pages = self._pages(plan)
        if pages is None:
            raise LayoutError(
                f"layout {self.layout.format.name} packs tokens inside a block engine-privately, so only whole "
                f"blocks of {self.layout.block_size} tokens can be copied; got "
                f"{plan.slots.numel()} slots that do not fill whole blocks in order"
            )
        return pages
