"""kvplug plugin: the vLLM v1 integration (engine adapter ``vllm``).

``KVPlugConnector`` (in :mod:`kvplug_vllm.connector`) is vLLM's side; vLLM finds it
through the ``vllm.general_plugins`` entry point (:func:`kvplug_vllm.registration.register`).
This module is kvplug's side: it lists the adapter and lets ``kvplug demo`` run the
real engine. Importing it does not import vLLM.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import kvplug
from kvplug_vllm.adapter import VLLMEngineAdapter
from kvplug_vllm.identity import CONNECTOR_NAME

__all__ = ["CONNECTOR_NAME", "VLLMEngineAdapter"]


@kvplug.hookimpl
def kvplug_engine_adapters() -> list[type]:
    return [VLLMEngineAdapter]


#: Workers in this process that want kvplug's events (their chunk index), by id.
_LISTENERS: dict[int, Callable[[kvplug.KVEvent], None]] = {}
_LISTENERS_LOCK = threading.Lock()


def add_event_listener(listener: Callable[[kvplug.KVEvent], None]) -> int:
    """Deliver kvplug's events to ``listener`` until :func:`remove_event_listener`; returns its id."""
    with _LISTENERS_LOCK:
        token = id(listener)
        _LISTENERS[token] = listener
    return token


def remove_event_listener(token: int) -> None:
    with _LISTENERS_LOCK:
        _LISTENERS.pop(token, None)


@kvplug.hookimpl
def kvplug_on_event(event: kvplug.KVEvent) -> None:
    with _LISTENERS_LOCK:
        listeners = list(_LISTENERS.values())
    for listener in listeners:
        listener(event)
