"""Copies between the KV cache and chunk frames on several threads: one core does not saturate host memory.

A connector's ``gather_layer`` on host memory is a torch ``index_select``, which
releases the GIL but runs on one core: on a 2-core VM one thread
gathered at about 70% of a two-core ``copy_`` and two threads, each taking half of
the chunks, at 100-106% (bare ``index_select``; through the connector 65-77%
against 54-59%). Gathers of different chunks write disjoint frames, and writes of
different chunks or layers disjoint slots, so they need no lock. Every copy runs on
a copy thread with one OpenMP thread; the caller waits (see :class:`ParallelCopies`).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

#: The most threads ``auto`` picks: two cores already saturated memory here, and a
#: copy thread per core of a 64-core serving host would only contend with the engine.
MAX_AUTO_THREADS = 4


def auto_copy_threads() -> int:
    """Threads for ``copy_threads: auto``: torch's intra-op threads, at most :data:`MAX_AUTO_THREADS`."""
    return max(1, min(torch.get_num_threads(), MAX_AUTO_THREADS))


class ParallelCopies:
    """Runs batches of independent copies on ``threads`` copy threads while the caller waits.

    ``run`` returns when every copy of the batch has finished, so a caller never sees
    a copy still writing after it returns (or raises). The caller's thread copies
    nothing itself: it keeps torch's intra-op team, and a chunk's copies are too small
    for a team to pay off (2-core VM, 96 MiB of 256-token chunks written into a block-packed
    CPU cache: 40 ms on a thread with two OpenMP threads, 25 ms on a copy thread with
    one), while a caller's team next to the copy threads oversubscribed the cores.
    """

    def __init__(self, threads: int) -> None:
        if threads < 1:
            raise ValueError(f"copy threads must be at least 1, got {threads}")
        self.threads = threads
        self._pool = (
            ThreadPoolExecutor(threads, thread_name_prefix="kvplug-copy", initializer=_one_intra_op_thread)
            if threads > 1
            else None
        )

    def run(self, copies: Sequence[Callable[[], None]], *, parallel: bool = True) -> None:
        """Run every copy; the first exception raised is re-raised once all have finished.

        ``parallel=False`` runs them in order on the caller's thread (copies onto a
        device are queued on its stream: threads would add nothing but overhead).
        """
        if self._pool is None or not parallel or len(copies) < 2:
            for copy in copies:
                copy()
            return
        shares = _split(copies, min(self.threads, len(copies)))
        # Inference and grad mode are per thread: the copy threads take the caller's, or
        # they could not write the inference tensors of an engine that runs in inference mode.
        modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        futures: list[Future[None]] = [self._pool.submit(_run_share, share, modes) for share in shares]
        error: BaseException | None = None
        for future in futures:  # every share is waited for: none may still write once this returns
            failure = future.exception()
            if error is None and failure is not None:
                error = failure
        if error is not None:
            raise error

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _one_intra_op_thread() -> None:
    """Copy threads run their copies on one core: the parallelism is the threads themselves.

    Left at torch's default, the first large copy on a copy thread gives it an OpenMP
    team of its own. libgomp then manages more threads than there are cores and stops
    spinning between parallel regions, so every later small parallel op of the engine's
    own thread pays a futex wake-up: on the 2-core VM, 512 slice copies of 512 KiB on
    the main thread took 38-51 ms instead of 26 ms for as long as such a thread lived
    (a token-pool load at 21% of ``copy_`` instead of 38%).

    ``torch.set_num_threads(1)`` is not the way: it also sets torch's process-wide
    default, which every thread that starts using torch later (the engine's among them)
    then takes. The OpenMP runtime's own ``omp_set_num_threads`` sets this thread's
    limit only; torch's lazy per-thread set-up runs first so that it cannot undo it.
    """
    torch.get_num_threads()
    runtime = _openmp_runtime()
    if runtime is not None:
        runtime.omp_set_num_threads(1)


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp, libiomp5 or libomp), or None where it cannot be found."""
    try:
        with open("/proc/self/maps") as maps:  # Linux: the copy torch uses, not just any on the path
            paths = sorted({line.split()[-1] for line in maps if any(name in line for name in _OPENMP_LIBRARIES)})
        for path in paths:
            if path.startswith("/"):
                return ctypes.CDLL(path)
    except OSError:  # no /proc (macOS, Windows), or the library will not open: torch's default stays
        pass
    return None


_OPENMP_LIBRARIES = ("/libgomp", "/libiomp5", "/libomp")


def _split(copies: Sequence[Callable[[], None]], parts: int) -> list[Sequence[Callable[[], None]]]:
    """``copies`` in ``parts`` contiguous shares of near-equal length."""
    size, extra = divmod(len(copies), parts)
    shares, start = [], 0
    for index in range(parts):
        end = start + size + (index < extra)
        shares.append(copies[start:end])
        start = end
    return shares


def _run_share(share: Sequence[Callable[[], None]], modes: tuple[bool, bool]) -> None:
    inference, grad = modes
    with torch.inference_mode(inference), torch.set_grad_enabled(grad):
        for copy in share:
            copy()
