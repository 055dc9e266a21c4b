"""How a :class:`~kvplug.core.record_tier.RecordTier` calls its backend: records framed
in batches the backend's :class:`~kvplug.core.record_backend.CallSizes` allow, and each
batch run under the tier's :class:`~kvplug.core.remote.RemoteCalls` (deadlines, retries,
the breaker), or on the calling thread for a backend that ``runs_inline``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TypeVar

from kvplug.core.record import key_digest, pack_record_header
from kvplug.core.record_backend import CallSizes, RecordBackend, RecordToWrite
from kvplug.core.remote import RemoteCalls
from kvplug.core.retry import Absent
from kvplug.core.tier import Buffer

T = TypeVar("T")
A = TypeVar("A")
#: (key text, its framed record) pairs of one write call.
WriteBatch = list[tuple[str, RecordToWrite]]


def framed_batches(
    keys: list[str], values: dict[str, Buffer], sizes: CallSizes, made: list[WriteBatch]
) -> Iterator[WriteBatch]:
    """The records of ``keys`` framed lazily, in batches of ``sizes.write`` records and
    ``sizes.write_bytes`` bytes (at least one record each), so the first batch is sent
    while later values are framed. Each batch is also appended to ``made``."""
    current: WriteBatch = []
    size = 0
    for key in keys:
        view = memoryview(values[key])
        value = view.cast("B") if view.nbytes else memoryview(b"")
        record = RecordToWrite(key_digest(key).hex(), pack_record_header(key, value), value)
        if current and (len(current) >= sizes.write or size + record.size > sizes.write_bytes):
            made.append(current)
            yield current
            current, size = [], 0
        current.append((key, record))
        size += record.size
    if current:
        made.append(current)
        yield current


def run_batch(
    backend: RecordBackend, calls: RemoteCalls, operation: Callable[[A], Awaitable[T]], arguments: Iterable[A]
) -> list[T | BaseException]:
    """``operation`` on each argument: concurrently on the tier's loop (see
    :meth:`RemoteCalls.batch`), or one after another on this thread when the backend
    ``runs_inline``. Each result is the value, :class:`Absent`, or the exception that ended it."""
    if not backend.runs_inline:
        return calls.batch(operation, arguments)
    return [_run_inline(backend, calls, operation(argument)) for argument in arguments]


def _run_inline(backend: RecordBackend, calls: RemoteCalls, call: Awaitable[T]) -> T | BaseException:
    """Drive a ``runs_inline`` backend's coroutine on this thread."""
    coroutine = call.__await__()
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]
    except (Absent, FileNotFoundError):
        return Absent()
    except Exception as exc:
        calls.failed += 1
        calls.context.logger.warning("tier %s: a call on %s failed: %r", calls.tier, calls.where, exc)
        return exc
    coroutine.close()
    raise TypeError(f"{type(backend).__name__} runs_inline, but its coroutine suspended")
