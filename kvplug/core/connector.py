"""The KV connector contract: paged engine cache <-> contiguous chunk tensors."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from kvplug.core.components import EmptyConfig
from kvplug.core.layouts import KVLayout
from kvplug.core.lazy_module import LazyModule

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: One layer's cache as the engine holds it: a tensor, or a tuple of them (K and V kept apart);
#: the layout's :class:`~kvplug.PagedFormat` says which.
LayerCache = Any


class KVConnector(ABC):
    """Copies KV between an engine's paged cache and chunk tensors.

    Chunk tensors are ``[num_kv, num_tokens, token_width]`` per layer and
    ``[num_layers, num_kv, num_tokens, token_width]`` per chunk, on the CPU.
    ``slots`` is a ``torch.long`` tensor on the cache's device.
    """

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = EmptyConfig
    #: Whether ``gather_layer`` may run on several threads at once for different chunks
    #: (disjoint frames). The engine then splits gathers out of a host cache across its
    #: ``copy_threads``; a connector with per-call state it does not guard says no.
    concurrent_copies: ClassVar[bool] = False
    #: Rank of this connector for ``connector: {type: auto}``: the engine picks the
    #: available connector (``is_available``) with the highest priority. The built-in
    #: ``torch`` connector, which runs everywhere, has 0; faster ones that need
    #: something (a C extension, a GPU) declare more (``native`` 5, ``cuda`` 10).
    priority: ClassVar[int] = 0

    def __init__(self, config: BaseModel, layout: KVLayout) -> None:
        self.config = config
        self.layout = layout

    @classmethod
    def is_available(cls) -> bool:
        """Whether this connector can run in this process."""
        return True

    def wants_pinned_frames(self) -> bool:
        """Whether the engine should page-lock its host frames for this connector.

        A connector that moves KV to and from a CUDA device says yes: it can then DMA
        straight between the device and the frames a chunk is serialized in.
        """
        return False

    def plan(self, slots: torch.Tensor) -> Any:
        """Precompute the addressing of ``slots`` once for all layers of a chunk.

        The engine passes the result to ``gather_layer``/``scatter_layer``. The
        default is the slot tensor itself.
        """
        return slots

    def plan_many(self, slots: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[Any]:
        """Plans of ``slots[start:end]`` for each ``(start, end)`` of ``spans``: the chunks of one engine call.

        The default calls :meth:`plan` per span. A connector whose planning runs
        device or tensor ops per call can do them once for the whole slot tensor;
        its plans must be the ones :meth:`plan` gives for each span.
        """
        return [self.plan(slots[start:end]) for start, end in spans]

    @abstractmethod
    def gather_layer(self, layer_cache: LayerCache, plan: Any, out: torch.Tensor) -> None:
        """Copy the KV of the planned slots of one layer into ``out`` ``[num_kv, n, width]``."""

    @abstractmethod
    def scatter_layer(self, layer_cache: LayerCache, plan: Any, src: torch.Tensor) -> None:
        """Write ``src`` ``[num_kv, n, width]`` into the planned slots of one layer."""

    def gather_copies(
        self,
        kv_caches: Sequence[LayerCache],
        layers: range,
        plans: Sequence[Any],
        chunks: Sequence[torch.Tensor],
        parts: int,
    ) -> list[Callable[[], None]]:
        """The copies that gather ``layers`` of every planned chunk of an engine call.

        ``plans[i]`` (from :meth:`plan_many`) goes with ``chunks[i]``, a chunk tensor
        ``[num_layers, num_kv, n, width]`` whose ``n`` is that plan's slot count. The engine
        runs the returned copies at once, on its ``parts`` copy threads when
        ``concurrent_copies`` and the cache is in host memory, and returns when all have
        finished. The default is one :meth:`gather_layer` per layer and chunk; a
        connector that copies a whole batch in one call returns about ``parts`` copies.
        """
        return [
            partial(self.gather_layer, kv_caches[layer], plan, chunk[layer])
            for layer in layers
            for plan, chunk in zip(plans, chunks)
        ]

    def scatter_copies(
        self,
        kv_caches: Sequence[LayerCache],
        layers: range,
        plans: Sequence[Any],
        chunks: Sequence[torch.Tensor],
        parts: int,
    ) -> list[Callable[[], None]]:
        """The copies that write ``layers`` of every chunk into its planned slots: :meth:`gather_copies` reversed.

        Different chunks never share a slot, so the copies may run in any order. The
        default is one :meth:`scatter_layer` per layer and chunk.
        """
        return [
            partial(self.scatter_layer, kv_caches[layer], plan, chunk[layer])
            for layer in layers
            for plan, chunk in zip(plans, chunks)
        ]

    def synchronize(self) -> None:  # noqa: B027 - host copies are done when issued; device connectors override
        """Wait for copies issued so far (device connectors override)."""
