"""What decoding a hostile frame costs: for serializers' fuzz and regression tests.

A frame is untrusted input (anyone who can write a store can write one). Whatever its
header and payload say, ``loads`` must end quickly, in a specific
:class:`~kvplug.errors.ChunkError` subclass or a tensor of the right shape, and must
never allocate much more than the chunk. :func:`measure_decode` runs one decode and
records its time and memory two ways: tracemalloc's peak (exact, for every allocation
made through Python's allocator: ``bytes``, ``bytearray``, lists, and what C extensions
such as python-zstandard return) and the growth of the process's peak resident set
(``ru_maxrss``: any memory that was touched, torch's and native libraries' included).
The second one is only meaningful in a fresh, small process, so tests run their
decodes in a subprocess (:func:`run_fresh`) that first calls :func:`cap_memory`: on a
build without the bound, a frame declaring 8 GiB then fails in that process instead
of taking the machine's memory.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvplug.errors import ChunkError

#: Allowance of the resident-set check for the interpreter's and allocators' own noise.
RSS_SLACK_BYTES = 64 * 2**20
#: Allowance of the tracemalloc check (exception objects, tracebacks, small lists).
TRACED_SLACK_BYTES = 256 * 2**10


@dataclass(frozen=True)
class DecodeCost:
    """One decode: what it gave (a result or the exception), how long and how much memory it took."""

    result: Any
    error: BaseException | None
    seconds: float
    traced_bytes: int
    rss_growth_bytes: int


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def measure_decode(decode: Callable[[], Any]) -> DecodeCost:
    """Run ``decode()`` once, catching any exception, under tracemalloc and ``ru_maxrss``."""
    tracemalloc.start()
    rss_before = _peak_rss()
    started = time.perf_counter()
    result: Any = None
    error: BaseException | None = None
    try:
        result = decode()
    except Exception as exc:  # the caller judges which ones are allowed
        error = exc
    seconds = time.perf_counter() - started
    rss_growth = _peak_rss() - rss_before
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return DecodeCost(result, error, seconds, traced, rss_growth)


def assert_bounded(
    cost: DecodeCost,
    *,
    chunk_bytes: int,
    shape: tuple[int, ...] | None = None,
    max_seconds: float = 1.0,
    context: str = "",
) -> None:
    """``AssertionError`` unless the decode ended in a specific ``ChunkError`` subclass or a
    tensor (of ``shape`` when given), within ``max_seconds``, using less than twice
    ``chunk_bytes`` (plus :data:`TRACED_SLACK_BYTES` / :data:`RSS_SLACK_BYTES`)."""
    where = f" ({context})" if context else ""
    if cost.error is not None:
        assert isinstance(cost.error, ChunkError) and type(cost.error) is not ChunkError, (
            f"decode raised {type(cost.error).__name__}: {cost.error}{where}"
        )
    elif shape is not None:
        assert tuple(cost.result.shape) == tuple(shape), f"decoded shape {tuple(cost.result.shape)}, not {shape}{where}"
    assert cost.seconds < max_seconds, f"decode took {cost.seconds:.2f} s{where}"
    assert cost.traced_bytes < 2 * chunk_bytes + TRACED_SLACK_BYTES, (
        f"decode allocated {cost.traced_bytes} bytes (tracemalloc) for a {chunk_bytes}-byte chunk{where}"
    )
    assert cost.rss_growth_bytes < 2 * chunk_bytes + RSS_SLACK_BYTES, (
        f"decode grew the peak RSS by {cost.rss_growth_bytes} bytes for a {chunk_bytes}-byte chunk{where}"
    )


def cap_memory(margin_bytes: int = 3 * 2**30) -> None:
    """Limit this process's address space to what it maps now plus ``margin_bytes`` (Linux).

    For the subprocess of a test: a decode that tries to allocate past it gets a
    ``MemoryError`` there (a failed test) instead of the machine's memory.
    """
    with open("/proc/self/status") as status:
        mapped = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (mapped + margin_bytes, resource.RLIM_INFINITY))


def run_fresh(script: str | Path, *args: str, timeout_s: float = 300) -> str:
    """Run ``python script args`` in a new process; ``AssertionError`` with its output if it fails.

    Returns its output. The script decides what it checks (it runs
    :func:`measure_decode` and :func:`assert_bounded` on its own decodes).
    """
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    done = subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{Path(script).name} {' '.join(args)} exited {done.returncode}:\n{output[-6000:]}"
    return output
