"""Callbacks of one kind that any thread adds, removes and calls: :class:`Listeners`."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, ParamSpec

P = ParamSpec("P")


class Listeners(Generic[P]):
    """A set of callbacks taking ``P``, called in the order they were added.

    A listener is called on the thread that calls :meth:`call_each` (often a storage
    worker): it must be quick. One that raises is logged on ``logger``; the others still
    run. The list is replaced, never mutated, so calls read it without the lock.
    """

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self._listeners: tuple[Callable[P, None], ...] = ()
        self._lock = threading.Lock()

    def add(self, listener: Callable[P, None]) -> None:
        with self._lock:
            self._listeners = (*self._listeners, listener)

    def remove(self, listener: Callable[P, None]) -> None:
        """Stop calling ``listener`` (once, if it was added twice); nothing happens if it was not added."""
        with self._lock:
            listeners = list(self._listeners)
            if listener in listeners:
                listeners.remove(listener)
            self._listeners = tuple(listeners)

    def call_each(self, *args: P.args, **kwargs: P.kwargs) -> None:
        for listener in self._listeners:
            try:
                listener(*args, **kwargs)
            except Exception:
                self._logger.exception("%s %r failed", self._what, listener)
