"""KV connector ``cuda``: Triton paged-copy kernels, pinned staging, a dedicated copy stream.

Store (gather), per call::

    engine stream:  [paged-copy kernel: cache -> device staging] --event-->
    copy stream:                            wait event, [DMA staging -> pinned buffer] --done-->
    host, later:    (reap / synchronize) done? copy pinned buffer -> serializer frame, release

Retrieve (scatter), per call::

    host:           copy chunk (CPU frame) -> pinned buffer
    copy stream:    [DMA pinned buffer -> device staging] --done-->
    engine stream:  wait done, [paged-copy kernel: staging -> cache]

When the frame itself is pinned (the engine page-locks its frame pool for this
connector, see ``wants_pinned_frames``) the DMA goes straight to or from the frame:
no pinned buffer, no host copy, so a chunk crosses host memory once.

The kernels run on the engine's current stream, so they are ordered with the
engine's own reads and writes of the cache without any host synchronisation, and
they are short (device memory speed). Only the PCIe transfers run on the copy
stream: loading layer ``l + 1`` overlaps the engine's compute of layer ``l``, and
storing layer ``l`` overlaps the compute of layer ``l + 1``. ``synchronize`` waits
(with a deadline) for the transfers issued so far and releases their buffers.

Formats that copy whole blocks only (``whole_blocks_only``, e.g. vLLM's CPU layout:
host memory, blocks packed per CPU ISA) always go to the torch connector. Other caches on the CPU go to it too, except under
Triton's interpreter (``TRITON_INTERPRET=1``), where the kernels run on CPU tensors
and the staging/bookkeeping path is exercised without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import ByteSize, Field

from kvplug import ComponentConfig, KVConnector, KVLayout, LazyModule, TimeoutSeconds, TorchConnector
from kvplug.errors import ConnectorError, LayoutError
from kvplug_cuda.addressing import (
    PagedAddressing,
    base_tensor,
    cache_key,
    kernel_fits,
    layer_tensors,
    paged_addressing,
)
from kvplug_cuda.pinned_pool import PinnedBuffer, PinnedPool, PoolStats
from kvplug_cuda.transfers import InFlight, Transfers

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Addressing tables kept per connector: every layer alone plus a few whole-model sets.
_MAX_TABLES = 1024


class CudaConnectorConfig(ComponentConfig):
    """Options of the ``cuda`` connector."""

    pinned_pool_bytes: ByteSize = Field(
        default=ByteSize(256 * 1024**2),
        description="Most pinned host memory held for staging; a chunk layer must fit in it.",
    )
    pool_timeout_s: TimeoutSeconds = Field(
        default=2.0, description="Longest wait for a free pinned buffer; then a miss."
    )
    copy_timeout_s: TimeoutSeconds = Field(default=30.0, description="Longest wait for issued copies in synchronize().")


@dataclass
class CudaPlan:
    """A chunk's slots (int64, per device they are needed on) and their range."""

    slots: torch.Tensor
    max_slot: int
    _by_device: dict[torch.device, torch.Tensor] = field(default_factory=dict)
    _reference: Any = None

    def on(self, device: torch.device) -> torch.Tensor:
        if self.slots.device == device:
            return self.slots
        if device not in self._by_device:
            self._by_device[device] = self.slots.to(device, non_blocking=True)
        return self._by_device[device]


@dataclass
class TransferStats:
    """Counters of a :class:`CudaConnector`; ``pool`` is its pinned pool's."""

    gathers: int = 0
    scatters: int = 0
    bytes_to_host: int = 0
    bytes_to_device: int = 0
    timeouts: int = 0
    fallbacks: int = 0
    pool: PoolStats | None = None


class CudaConnector(KVConnector):
    """Moves chunks between a CUDA paged KV cache and host memory near PCIe bandwidth."""

    name = "cuda"
    priority: ClassVar[int] = 10
    Config = CudaConnectorConfig

    def __init__(self, config: CudaConnectorConfig, layout: KVLayout) -> None:
        super().__init__(config, layout)
        self.options = config  # typed: the base class keeps ``config`` as a plain BaseModel
        from kvplug_cuda import kernels  # triton is imported only by a connector that runs

        self._kernels = kernels
        self._interpreted = kernels.interpreted()
        if not torch.cuda.is_available() and not self._interpreted:
            raise ConnectorError(
                "connector 'cuda' needs a CUDA device, and torch.cuda.is_available() is False; "
                "use connector: {type: torch} or {type: auto}"
            )
        self._reference = TorchConnector(TorchConnector.Config(), layout)
        self._lock = threading.Lock()
        self._tables: OrderedDict[tuple[object, ...], PagedAddressing] = OrderedDict()
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._stats = TransferStats()
        self.pool = PinnedPool(
            int(config.pinned_pool_bytes),
            pin=torch.cuda.is_available(),
            timeout_s=config.pool_timeout_s,
            reclaim=lambda deadline: self._transfers.finish_oldest(deadline),
        )
        self._transfers = Transfers(self.pool.release)

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available() and importlib.util.find_spec("triton") is not None

    def wants_pinned_frames(self) -> bool:
        return torch.cuda.is_available() and kernel_fits(self.layout)

    # --- the connector contract ----------------------------------------------------------

    def plan(self, slots: torch.Tensor) -> CudaPlan:
        slots = slots.to(torch.long).contiguous()
        if slots.dim() != 1:
            raise LayoutError(f"slots must be 1-D, got shape {tuple(slots.shape)}")
        if slots.numel() == 0:
            return CudaPlan(slots, -1)
        low, high = torch.stack(torch.aminmax(slots)).tolist()  # one sync, like the torch connector's plan
        if low < 0:
            raise LayoutError(f"slot mapping holds negative slot {low}")
        return CudaPlan(slots, high)

    def gather_layer(self, layer_cache: Any, plan: CudaPlan, out: torch.Tensor) -> None:
        self._gather([layer_cache], plan, out.unsqueeze(0))

    def scatter_layer(self, layer_cache: Any, plan: CudaPlan, src: torch.Tensor) -> None:
        self._scatter([layer_cache], plan, src.unsqueeze(0))

    def gather(self, kv_caches: Sequence[Any], slots: torch.Tensor, out: torch.Tensor) -> None:
        """All layers of a chunk in one kernel launch and one transfer (per layer if too big)."""
        plan = self.plan(slots)
        if self._fits_one_launch(kv_caches, out):
            self._gather(kv_caches, plan, out)
        else:
            for layer, cache in enumerate(kv_caches):
                self._gather([cache], plan, out[layer].unsqueeze(0))

    def scatter(self, kv_caches: Sequence[Any], slots: torch.Tensor, src: torch.Tensor) -> None:
        plan = self.plan(slots)
        if self._fits_one_launch(kv_caches, src):
            self._scatter(kv_caches, plan, src)
        else:
            for layer, cache in enumerate(kv_caches):
                self._scatter([cache], plan, src[layer].unsqueeze(0))

    def synchronize(self) -> None:
        """Wait for every issued transfer (at most ``copy_timeout_s``), then release buffers."""
        self._transfers.finish_all(self.options.copy_timeout_s)

    def release_caches(self) -> None:
        """Finish the issued transfers and forget every cache address (vLLM's sleep mode unmaps the caches).

        The addressing tables hold the caches' device addresses; the next copy builds its
        table again from the caches it is handed.
        """
        self.synchronize()
        with self._lock:
            self._tables.clear()

    def stats(self) -> TransferStats:
        with self._lock:
            snapshot = TransferStats(**{k: v for k, v in vars(self._stats).items() if k != "pool"})
        snapshot.timeouts = self._transfers.timeouts
        snapshot.pool = self.pool.stats()
        return snapshot

    def copy_stream(self, device: torch.device | None = None) -> torch.cuda.Stream:
        """The stream host<->device transfers for ``device`` run on (created on first use)."""
        device = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    # --- transfers -----------------------------------------------------------------------

    def _gather(self, caches: Sequence[Any], plan: CudaPlan, out: torch.Tensor) -> None:
        device = layer_tensors(self.layout, caches[0])[0].device
        if self._use_reference(device):
            self._stats.fallbacks += 1
            for layer, cache in enumerate(caches):
                self._reference.gather_layer(cache, self._reference_plan(plan), out[layer])
            return
        addressing, base = self._address(caches, plan)
        self._transfers.reap()
        nbytes = out.numel() * out.element_size()
        direct = device.type == "cuda" and _pinned_and_dense(out)
        buffer = None if direct else self._acquire(nbytes)
        try:
            slots = plan.on(device)
            if device.type == "cuda":
                words = nbytes // addressing.word_size
                staging = torch.empty(words, dtype=addressing.word, device=device)
                self._kernels.paged_copy(addressing, base, slots, staging, to_chunk=True)
                host = _bytes_of(out) if buffer is None else buffer.view(torch.uint8)
                stream = self.copy_stream(device)
                stream.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(stream):
                    host.copy_(staging.view(torch.uint8), non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                staging.record_stream(stream)  # not reused before the transfer read it
            else:
                assert buffer is not None
                self._kernels.paged_copy(addressing, base, slots, buffer.view(addressing.word), to_chunk=True)
                event = None
        except BaseException:
            if buffer is not None:
                self.pool.release(buffer)
            raise
        if buffer is None:
            self._transfers.issue(InFlight(event, None, None, host=out))
        else:
            staged = buffer.view(out.dtype, tuple(out.shape))
            self._transfers.issue(InFlight(event, buffer, lambda: out.copy_(staged)))
        with self._lock:
            self._stats.gathers += 1
            self._stats.bytes_to_host += nbytes

    def _scatter(self, caches: Sequence[Any], plan: CudaPlan, src: torch.Tensor) -> None:
        device = layer_tensors(self.layout, caches[0])[0].device
        if self._use_reference(device):
            self._stats.fallbacks += 1
            for layer, cache in enumerate(caches):
                self._reference.scatter_layer(cache, self._reference_plan(plan), src[layer])
            return
        addressing, base = self._address(caches, plan)
        if src.dtype != self.layout.dtype:
            raise LayoutError(f"chunk dtype {src.dtype} does not match the layout's {self.layout.dtype}")
        self._transfers.reap()
        nbytes = src.numel() * src.element_size()
        direct = device.type == "cuda" and _pinned_and_dense(src)
        buffer = None if direct else self._acquire(nbytes)
        try:
            if buffer is not None:
                # Also gathers a non-contiguous src (a chunk's tail slice) into one run.
                buffer.view(src.dtype, tuple(src.shape)).copy_(src)
            slots = plan.on(device)
            if device.type == "cuda":
                host = _bytes_of(src) if buffer is None else buffer.view(torch.uint8)
                stream = self.copy_stream(device)
                current = torch.cuda.current_stream(device)
                with torch.cuda.stream(stream):
                    staging = torch.empty(nbytes // addressing.word_size, dtype=addressing.word, device=device)
                    staging.view(torch.uint8).copy_(host, non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                current.wait_event(event)
                self._kernels.paged_copy(addressing, base, slots, staging, to_chunk=False)
                staging.record_stream(current)  # not reused before the kernel read it
            else:
                assert buffer is not None
                self._kernels.paged_copy(addressing, base, slots, buffer.view(addressing.word), to_chunk=False)
                event = None
        except BaseException:
            if buffer is not None:
                self.pool.release(buffer)
            raise
        self._transfers.issue(InFlight(event, buffer, None, host=src if buffer is None else None))
        with self._lock:
            self._stats.scatters += 1
            self._stats.bytes_to_device += nbytes

    # --- bookkeeping ---------------------------------------------------------------------

    def _acquire(self, nbytes: int) -> PinnedBuffer:
        try:
            return self.pool.acquire(nbytes)
        except ConnectorError:
            # Finish what is in flight while the engine still owns its destinations: once
            # the error reaches it, it may recycle frames that late copies would write.
            with contextlib.suppress(ConnectorError):
                self.synchronize()
            raise

    def _use_reference(self, device: torch.device) -> bool:
        if not kernel_fits(self.layout):  # opaque blocks (vLLM CPU: host memory), or head rows that are not runs
            return True
        return device.type != "cuda" and not self._interpreted

    def _reference_plan(self, plan: CudaPlan) -> Any:
        if plan._reference is None:
            plan._reference = self._reference.plan(plan.slots)
        return plan._reference

    def _address(self, caches: Sequence[Any], plan: CudaPlan) -> tuple[PagedAddressing, torch.Tensor]:
        key = cache_key(self.layout, caches)
        with self._lock:
            addressing = self._tables.get(key)
            if addressing is not None:
                self._tables.move_to_end(key)
        if addressing is None:
            for cache in caches:
                for tensor in layer_tensors(self.layout, cache):
                    if tensor.dtype != self.layout.dtype:
                        raise LayoutError(f"cache dtype {tensor.dtype} does not match the layout's {self.layout.dtype}")
            addressing = paged_addressing(self.layout, caches)
            with self._lock:
                self._tables[key] = addressing
                while len(self._tables) > _MAX_TABLES:
                    self._tables.popitem(last=False)
        if plan.max_slot >= addressing.num_slots:
            raise LayoutError(f"slot {plan.max_slot} is outside the cache's {addressing.num_slots} slots")
        return addressing, base_tensor(self.layout, caches, addressing.word)

    def _fits_one_launch(self, kv_caches: Sequence[Any], chunk: torch.Tensor) -> bool:
        """All layers at once when the staging fits half the pool and the layers are alike."""
        if chunk.numel() * chunk.element_size() * 2 > self.pool.capacity_bytes:
            return False
        shapes = {
            (tuple(t.shape), t.stride(), t.device) for cache in kv_caches for t in layer_tensors(self.layout, cache)
        }
        return len(shapes) == 1


def _pinned_and_dense(tensor: torch.Tensor) -> bool:
    """Whether the device can DMA this host tensor as one run (a frame of a pinned pool)."""
    return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.is_pinned()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes."""
    return tensor.reshape(-1).view(torch.uint8)
