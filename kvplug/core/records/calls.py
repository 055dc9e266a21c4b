"""How a :class:`~kvplug.core.records.tier.RecordTier` calls its backend: records framed
in batches the backend's :class:`~kvplug.core.records.backend.CallSizes` allow, and each
batch run under the tier's :class:`~kvplug.core.remote.calls.RemoteCalls` (deadlines, retries,
the breaker), or on the calling thread for a backend that ``runs_inline``.

Every answer is checked before the tier reads anything into it: one entry per name asked
(:func:`one_each`), and no record in another name's place (:func:`checked_reads`). A
backend that answers otherwise has failed the call (:class:`kvplug.errors.BackendAnswerError`,
counted towards the breaker), so its mistake never reads as records gone or stored under
the wrong key, which the tier would forget or delete."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from typing import TypeVar

from kvplug.core.records.backend import CallSizes, RecordBackend, RecordToWrite
from kvplug.core.records.frame import RECORD_HEADER_SIZE, RECORD_MAGIC, key_digest, pack_record_header
from kvplug.core.remote.calls import RemoteCalls
from kvplug.core.remote.retry import Absent
from kvplug.core.tier import Buffer
from kvplug.errors import BackendAnswerError

T = TypeVar("T")
A = TypeVar("A")
#: (key text, its framed record) pairs of one write call.
WriteBatch = list[tuple[str, RecordToWrite]]
#: Where a record's header holds the sha256 of its key (:mod:`kvplug.core.records.frame`).
_DIGEST = slice(16, 48)


def one_each(asked: Sequence[object], answer: Sequence[T], call: str) -> Sequence[T]:
    """``answer``, which must hold one entry per item ``asked``; raises
    :class:`BackendAnswerError` otherwise (read into the names, it would shift every
    answer onto another name)."""
    if len(answer) != len(asked):
        raise BackendAnswerError(f"{call} answered {len(answer)} entries for {len(asked)} names")
    return answer


def answering_each(
    operation: Callable[[Sequence[A]], Awaitable[Sequence[T]]],
) -> Callable[[Sequence[A]], Awaitable[Sequence[T]]]:
    """``operation`` (a primitive over a batch) with its answers checked by :func:`one_each`."""
    call = getattr(operation, "__name__", "call")

    async def checked(asked: Sequence[A]) -> Sequence[T]:
        return one_each(asked, await operation(asked), call)

    return checked


def checked_reads(
    backend: RecordBackend,
) -> Callable[[Sequence[tuple[str, int | None]]], Awaitable[Sequence[Buffer | None | BaseException]]]:
    """:meth:`RecordBackend.read` of (name, size hint) pairs, checked: one answer per name,
    and a record whose header names another key only where the store holds it (read again
    alone, with :meth:`~RecordBackend.peek`, the name gives the same record); the tier then
    deletes it as stored under another key. Otherwise the backend put a record in another
    name's place: :class:`BackendAnswerError`, and nothing is deleted."""

    async def read(pairs: Sequence[tuple[str, int | None]]) -> Sequence[Buffer | None | BaseException]:
        names = [name for name, _ in pairs]
        answer = one_each(names, await backend.read(names, [size for _, size in pairs]), "read")
        for (name, size), data in zip(pairs, answer):
            found = _digest_of(data)
            if found is None or found == bytes.fromhex(name):
                continue
            (again,) = one_each([name], await backend.peek([name], [size]), "peek")
            if _digest_of(again) != found:
                raise BackendAnswerError(f"read answered {name} with the record of another name")
        return answer

    return read


def _digest_of(data: Buffer | None | BaseException) -> bytes | None:
    """The key digest in a record's header; ``None`` for what is not a record (left to the tier's checks)."""
    if data is None or isinstance(data, BaseException):
        return None
    try:
        view = memoryview(data).cast("B")
    except TypeError:  # not contiguous: the tier's checks refuse it
        return None
    if view.nbytes < RECORD_HEADER_SIZE or bytes(view[:4]) != RECORD_MAGIC:
        return None
    return bytes(view[_DIGEST])


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
