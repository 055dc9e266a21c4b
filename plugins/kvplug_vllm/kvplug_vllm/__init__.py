"""kvplug plugin: the vLLM v1 integration (engine adapter ``vllm``).

``KVPlugConnector`` (in :mod:`kvplug_vllm.connector`) is vLLM's side; vLLM finds it
through the ``vllm.general_plugins`` entry point (:func:`kvplug_vllm.registration.register`).
This module is kvplug's side: it lists the adapter and lets ``kvplug demo`` run the
real engine. Importing it does not import vLLM.
"""

from __future__ import annotations

import kvplug
from kvplug_vllm.adapter import VLLMEngineAdapter
from kvplug_vllm.identity import CONNECTOR_NAME

__all__ = ["CONNECTOR_NAME", "VLLMEngineAdapter"]


@kvplug.hookimpl
def kvplug_engine_adapters() -> list[type]:
    return [VLLMEngineAdapter]
