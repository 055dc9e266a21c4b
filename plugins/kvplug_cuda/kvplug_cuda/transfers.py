"""The ``cuda`` connector's issued host<->device transfers: finished oldest first, never waited on without a deadline.

A transfer is done when its CUDA event is; finishing it runs its host-side step (a
staged gather's copy into the frame) and gives its pinned buffer back to the pool. A
transfer past its deadline is abandoned: the device may still write its host memory,
so that memory is never handed out again.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvplug import LazyModule
from kvplug.errors import TransferTimeoutError
from kvplug_cuda.pinned_pool import PinnedBuffer

if TYPE_CHECKING:
    import torch
else:  # imported on first use: ``kvplug plugins`` and ``config validate`` load this module without torch
    torch = LazyModule("torch")

#: Longest pause between two polls of a transfer's event. A 32 MiB chunk crosses PCIe in
#: about 0.6 ms; pauses that doubled up to 1 ms made ``synchronize`` return up to 0.6 ms
#: after the copy ended (measured on an H200: a one-launch gather took 1.2 ms for a 0.63 ms
#: copy; now 0.90 ms). The kernel's timer slack adds about 50 us to any sleep.
MAX_POLL_PAUSE_S = 50e-6


@dataclass
class InFlight:
    """One issued transfer: done when ``event`` is (None: already done).

    ``buffer`` is the pool's staging buffer to release (None: the DMA used a pinned
    frame directly); ``host`` keeps that frame's tensor alive until then.
    """

    event: Any
    buffer: PinnedBuffer | None
    finish: Callable[[], object] | None
    host: torch.Tensor | None = None


class Transfers:
    """Issued transfers in issue order; ``release`` gives a finished one's pinned buffer back."""

    def __init__(self, release: Callable[[PinnedBuffer], None]) -> None:
        self._release = release
        self._lock = threading.Lock()
        self._inflight: deque[InFlight] = deque()
        self._abandoned: list[InFlight] = []
        self.timeouts = 0

    def issue(self, transfer: InFlight) -> None:
        with self._lock:
            self._inflight.append(transfer)

    def reap(self) -> None:
        """Finish the transfers that are already done, oldest first, without waiting."""
        while True:
            with self._lock:
                if not self._inflight or not done(self._inflight[0].event):
                    return
                transfer = self._inflight.popleft()
            self._complete(transfer)

    def finish_all(self, timeout_s: float) -> None:
        """Wait for every issued transfer (at most ``timeout_s`` in all) and finish it."""
        deadline = time.monotonic() + timeout_s
        while self.finish_oldest(deadline):
            pass

    def finish_oldest(self, deadline: float) -> bool:
        """Wait (until ``deadline``) for the oldest transfer and finish it; False if none."""
        with self._lock:
            if not self._inflight:
                return False
            transfer = self._inflight.popleft()
        if not wait(transfer.event, deadline):
            with self._lock:
                self._abandoned.append(transfer)
                self.timeouts += 1
            what = "its pinned buffer" if transfer.buffer is not None else "its frame"
            raise TransferTimeoutError(
                f"a host<->device transfer did not complete within the deadline; {what} is abandoned, never reused"
            )
        self._complete(transfer)
        return True

    def _complete(self, transfer: InFlight) -> None:
        try:
            if transfer.finish is not None:
                transfer.finish()
        finally:
            if transfer.buffer is not None:
                self._release(transfer.buffer)


def done(event: Any) -> bool:
    return event is None or event.query()


def wait(event: Any, deadline: float) -> bool:
    """Poll ``event`` until it completes or ``deadline`` passes (never an unbounded wait).

    ``Event.synchronize`` would return sooner, but it cannot time out: a hung device
    would hang the engine's thread with it.
    """
    pause = 5e-6
    while not done(event):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, MAX_POLL_PAUSE_S)
    return True
