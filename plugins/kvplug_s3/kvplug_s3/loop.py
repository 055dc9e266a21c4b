"""The event loop thread a tier owns: every store operation runs on it, so one
batch of N objects is N concurrent requests, not N blocking calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvplug.errors import TierClosedError, TierUnavailableError

T = TypeVar("T")


class LoopThread:
    """A daemon thread running one asyncio loop until :meth:`close`."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if self._closed:
            coro.close()
            raise TierClosedError("the tier's event loop is stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """Run ``coro`` on the loop and wait at most ``timeout_s`` for it; on
        timeout it is cancelled and :class:`TierUnavailableError` raised."""
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TierUnavailableError(f"store operation took longer than {timeout_s:.1f} s; cancelled") from None
        except concurrent.futures.CancelledError:
            raise TierClosedError("the tier was closed during the operation") from None

    def close(self, final: Coroutine[Any, Any, object] | None = None, timeout_s: float = 5.0) -> None:
        """Cancel what still runs, await ``final`` (closing sessions), stop the loop
        and join the thread. Idempotent."""
        if self._closed:
            if final is not None:
                final.close()
            return

        async def shutdown() -> None:
            current = asyncio.current_task()
            pending = [t for t in asyncio.all_tasks() if t is not current]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            if final is not None:
                try:
                    await asyncio.wait_for(final, timeout_s)
                except Exception:  # noqa: BLE001 - a session that fails to close is gone anyway
                    pass

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(timeout_s * 2)
        except Exception:  # noqa: BLE001 - stop the loop whatever happened
            pass
        self._closed = True
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self.loop.close()
