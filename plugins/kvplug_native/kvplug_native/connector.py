"""KV connector ``native``: a call's copies in one C call, on torch's OpenMP team, with streaming stores.

For a KV cache in host memory (vLLM's and SGLang's CPU backends), the torch connector
issues one or more torch ops per chunk and layer: an 8192-token store is hundreds
of Python-dispatched ops, each a few microseconds of GIL time, and torch's CPU index
kernels write through the cache (every destination line is read before it is
overwritten). This connector turns a whole engine call into one table of byte runs
(:mod:`kvplug_native.runs`: found once per call with vectorized torch ops, merged
where blocks or slots follow each other) and copies it in C with the GIL released:
on the engine's main thread shared out among its OpenMP team (the one torch's ops
use), elsewhere one share per copy thread. Calls of ``streaming_min_bytes`` or more
are written with non-temporal stores, which skip that read.

Caches on a device, caches a run table cannot address (a ``head_dim`` axis that is
not contiguous) and layers of more than one dtype go to the torch connector, as do
chunk tensors that are not ``[num_layers, num_kv, n, width]`` of the layers' dtype with
contiguous token rows: it copies what fits and refuses the rest by name before any copy.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ByteSize, Field

from kvplug import ComponentConfig, KVConnector, KVLayout, LazyModule, TorchConnector
from kvplug.errors import ConnectorError
from kvplug_native.runs import NBYTES, Runs, find_runs, layer_geometry, run_table, split_table

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Batches from this size on are written with streaming stores by default: far past the
#: CPU caches, where the reader of the destination would not find it cached anyway.
DEFAULT_STREAMING_MIN_BYTES = 8 * 2**20


class NativeConnectorConfig(ComponentConfig):
    """Options of the ``native`` connector."""

    streaming_min_bytes: ByteSize | None = Field(
        default=ByteSize(DEFAULT_STREAMING_MIN_BYTES),
        description=(
            "copies of at least this many bytes in one engine call write with non-temporal (streaming) stores "
            "on x86-64: they skip reading each destination line before overwriting it; smaller copies use "
            "memcpy, whose writes stay in the CPU caches for the reader that follows. null: never stream"
        ),
    )


class _Call:
    """The slots of one engine call and the spans of its chunks; their runs are found once per cache geometry.

    The torch connector's plans are made only when needed: for the blocks of a packed
    format, or when the torch connector copies instead.
    """

    def __init__(self, torch_connector: TorchConnector, slots: torch.Tensor, spans: Sequence[tuple[int, int]]):
        self.slots = slots
        self.spans = list(spans)
        self._torch = torch_connector
        self._torch_plans: list[Any] | None = None
        self._runs: dict[tuple[object, ...], list[Runs] | None] = {}
        self._lock = threading.Lock()

    def torch_plans(self) -> list[Any]:
        with self._lock:
            if self._torch_plans is None:
                self._torch_plans = self._torch.plan_many(self.slots, self.spans)
            return self._torch_plans

    def runs(self, layout: KVLayout, tensors: Sequence[torch.Tensor]) -> list[Runs] | None:
        key = layer_geometry(tensors)
        blocks = [getattr(plan, "blocks", None) for plan in self.torch_plans()] if layout.whole_blocks_only else []
        with self._lock:
            if key not in self._runs:
                self._runs[key] = find_runs(layout, tensors, self.slots, self.spans, blocks)
            return self._runs[key]


@dataclass(frozen=True)
class NativePlan:
    """One chunk's slots: its span of an engine call (the torch connector's plan of it, for fallbacks, on demand)."""

    call: _Call
    index: int

    @property
    def num_slots(self) -> int:
        start, end = self.call.spans[self.index]
        return end - start

    @property
    def torch_plan(self) -> Any:
        return self.call.torch_plans()[self.index]


class _CopyRuns:
    """A run table (or a share of one) copied in one C call on ``threads`` threads; holds the table while it runs."""

    def __init__(
        self, copy_runs: Callable[[int, int, bool, int], None], table: torch.Tensor, streaming: bool, threads: int
    ) -> None:
        self._copy_runs = copy_runs
        self.table = table
        self.streaming = streaming
        self.threads = threads

    def __call__(self) -> None:
        self._copy_runs(self.table.data_ptr(), self.table.shape[0], self.streaming, self.threads)


class NativeConnector(KVConnector):
    """Copies KV between a host-memory paged cache and chunk tensors through run tables copied in C."""

    name = "native"
    #: Above the torch connector, below kvplug-cuda's (a CUDA cache is that one's job).
    priority: ClassVar[int] = 5
    concurrent_copies = True  # tables are built by the caller; shares of one copy disjoint bytes
    Config = NativeConnectorConfig

    def __init__(self, config: NativeConnectorConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        if not self.is_available():
            raise ConnectorError(
                "connector 'native' needs its C extension kvplug_native._copy, which is not built in this "
                "installation; reinstall kvplug-native with a C compiler, or use connector: {type: torch}"
            )
        from kvplug_native import _copy

        self.options = config  # typed: the base class keeps ``config`` as a plain BaseModel
        self._copy_runs = _copy.copy_runs
        self._streaming_stores = bool(_copy.STREAMING_STORES)
        self._openmp = bool(_copy.OPENMP)
        self._torch = TorchConnector(TorchConnector.Config(), layout)

    @classmethod
    def is_available(cls) -> bool:
        return importlib.util.find_spec("kvplug_native._copy") is not None

    # --- planning ------------------------------------------------------------------------

    def plan(self, slots: torch.Tensor) -> NativePlan:
        return self.plan_many(slots, [(0, slots.numel())])[0]

    def plan_many(self, slots: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[NativePlan]:
        call = _Call(self._torch, slots.to(torch.long), spans)
        return [NativePlan(call, index) for index in range(len(call.spans))]

    # --- copies --------------------------------------------------------------------------

    def gather_copies(
        self,
        kv_caches: Sequence[Any],
        layers: range,
        plans: Sequence[Any],
        chunks: Sequence[torch.Tensor],
        parts: int,
    ) -> list[Callable[[], None]]:
        return self._copies(kv_caches, layers, plans, chunks, parts, into_cache=False)

    def scatter_copies(
        self,
        kv_caches: Sequence[Any],
        layers: range,
        plans: Sequence[Any],
        chunks: Sequence[torch.Tensor],
        parts: int,
    ) -> list[Callable[[], None]]:
        return self._copies(kv_caches, layers, plans, chunks, parts, into_cache=True)

    def gather_layer(self, layer_cache: Any, plan: NativePlan, out: torch.Tensor) -> None:
        _run(self.gather_copies([layer_cache], range(1), [plan], [out.unsqueeze(0)], 1))

    def scatter_layer(self, layer_cache: Any, plan: NativePlan, src: torch.Tensor) -> None:
        _run(self.scatter_copies([layer_cache], range(1), [plan], [src.unsqueeze(0)], 1))

    def _copies(
        self,
        kv_caches: Sequence[Any],
        layers: range,
        plans: Sequence[NativePlan],
        chunks: Sequence[torch.Tensor],
        parts: int,
        *,
        into_cache: bool,
    ) -> list[Callable[[], None]]:
        """The run table's shares as copies, or the torch connector's copies where a table does not apply."""
        if not layers or not plans:
            return []
        table = self._table(kv_caches, layers, plans, chunks, into_cache=into_cache)
        if table is None:
            torch_copies = self._torch.scatter_copies if into_cache else self._torch.gather_copies
            return torch_copies(kv_caches, layers, _torch_plans(plans), chunks, parts)
        minimum = self.options.streaming_min_bytes
        streaming = (
            self._streaming_stores
            and minimum is not None
            and table.shape[0] > 0
            and int(table[:, NBYTES].sum()) >= minimum
        )
        if self._openmp and threading.current_thread() is threading.main_thread():
            # One copy, which the engine runs on this thread: the C call shares it out among the
            # thread's OpenMP team, whose workers torch's ops have just left spinning (_copy.c).
            return [_CopyRuns(self._copy_runs, table, streaming, parts)] if table.shape[0] else []
        # Elsewhere (a background load, or no OpenMP) a share per copy thread of the engine:
        # a team of OpenMP threads started for a background thread would stay next to the
        # engine's own team, and libgomp, seeing more threads than cores, makes every team
        # sleep instead of spin between parallel regions (the engine's small ops then wait).
        return [_CopyRuns(self._copy_runs, share, streaming, 1) for share in split_table(table, parts)]

    def _table(
        self,
        kv_caches: Sequence[Any],
        layers: range,
        plans: Sequence[NativePlan],
        chunks: Sequence[torch.Tensor],
        *,
        into_cache: bool,
    ) -> torch.Tensor | None:
        layer_tensors = {layer: self.layout.layer_tensors(kv_caches[layer]) for layer in layers}
        first = layer_tensors[layers[0]][0]
        # A table's byte offsets take one element size, and its addresses are host memory: a layer of
        # another dtype or device goes to the torch connector, which refuses the call by name or copies it.
        if not all(
            tensor.dtype == first.dtype and tensor.device.type == "cpu"
            for tensors in layer_tensors.values()
            for tensor in tensors
        ) or not all(_fits(chunk, plan, first.dtype, layers.stop, self.layout) for plan, chunk in zip(plans, chunks)):
            return None
        no_tensors = [0] * self.layout.format.tensors
        bases = torch.tensor(
            [
                [t.data_ptr() for t in layer_tensors[layer]] if layer in layer_tensors else no_tensors
                for layer in range(layers.stop)
            ],
            dtype=torch.long,
        )
        by_geometry: dict[tuple[object, ...], list[int]] = {}
        for layer, tensors in layer_tensors.items():
            by_geometry.setdefault(layer_geometry(tensors), []).append(layer)
        itemsize = first.element_size()
        tables = []
        for call, batch in _by_call(plans):
            # The chunks of this batch by span of their call (spans not in the batch: no rows).
            span_count = len(call.spans)
            chunk_rows = [[0, 0, 0]] * span_count
            for index, position in batch:
                chunk = chunks[position]
                chunk_rows[index] = [chunk.data_ptr(), chunk.stride(0) * itemsize, chunk.stride(1) * itemsize]
            chunk_table = torch.tensor(chunk_rows, dtype=torch.long)
            chunk_bases, chunk_strides = chunk_table[:, 0], chunk_table[:, 1:]
            for group in by_geometry.values():
                runs = call.runs(self.layout, layer_tensors[group[0]])
                if runs is None:
                    return None
                if len(batch) < span_count:
                    runs = _only_spans(runs, [index for index, _ in batch], span_count)
                tables.append(run_table(runs, bases, group, chunk_bases, chunk_strides, into_cache=into_cache))
        return torch.cat(tables) if len(tables) > 1 else tables[0]


def _fits(chunk: torch.Tensor, plan: Any, dtype: torch.dtype, layers: int, layout: KVLayout) -> bool:
    """Whether ``chunk`` is a host ``[>= layers, num_kv, n, width]`` tensor of the cache's dtype with dense token rows."""
    if not isinstance(plan, NativePlan):
        return False
    width = layout.token_width
    return (
        chunk.device.type == "cpu"
        and chunk.dtype == dtype
        and chunk.dim() == 4
        and chunk.shape[0] >= layers
        and tuple(chunk.shape[1:]) == (layout.num_kv, plan.num_slots, width)
        and (chunk.stride(3) == 1 or width == 1)
        and (chunk.stride(2) == width or plan.num_slots <= 1)
    )


def _by_call(plans: Sequence[NativePlan]) -> list[tuple[_Call, list[tuple[int, int]]]]:
    """Plans grouped by the engine call they came from: (call, [(span index, position in plans)]).

    A span given twice (one plan, two chunk tensors) starts another group, so that every
    group holds each span once: a run table has one chunk address per span.
    """
    groups: list[tuple[_Call, list[tuple[int, int]], set[int]]] = []
    for position, plan in enumerate(plans):
        group = next((g for g in groups if g[0] is plan.call and plan.index not in g[2]), None)
        if group is None:
            group = (plan.call, [], set())
            groups.append(group)
        _, batch, spans = group
        batch.append((plan.index, position))
        spans.add(plan.index)
    return [(call, batch) for call, batch, _ in groups]


def _only_spans(runs: list[Runs], spans: list[int], span_count: int) -> list[Runs]:
    keep = torch.zeros(span_count, dtype=torch.bool)
    keep[spans] = True
    picked = []
    for run in runs:
        mask = keep[run.chunk]
        picked.append(
            Runs(run.kv_index, run.tensor, run.chunk[mask], run.source[mask], run.target[mask], run.nbytes[mask])
        )
    return picked


def _torch_plans(plans: Sequence[Any]) -> list[Any]:
    return [plan.torch_plan if isinstance(plan, NativePlan) else plan for plan in plans]


def _run(copies: Sequence[Callable[[], None]]) -> None:
    for copy in copies:
        copy()
