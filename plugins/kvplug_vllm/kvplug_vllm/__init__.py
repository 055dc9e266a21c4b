"""kvplug plugin: the vLLM v1 integration (engine adapter ``vllm``).

``KVPlugConnector`` (in :mod:`kvplug_vllm.connector`) is vLLM's side; vLLM finds it
through the ``vllm.general_plugins`` entry point (:func:`kvplug_vllm.registration.register`).
This module is kvplug's side: it lists the adapter and lets ``kvplug demo`` run the
real engine. Importing it does not import vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import kvplug

if TYPE_CHECKING:
    from kvplug_vllm.adapter import VLLMEngineAdapter
    from kvplug_vllm.identity import CONNECTOR_NAME

#: Exported name -> its module, imported on first use: registering the plugin (every
#: ``kvplug`` command does) imports none of them, nor what they import (torch).
_LAZY = {
    "VLLMEngineAdapter": "kvplug_vllm.adapter",
    "CONNECTOR_NAME": "kvplug_vllm.identity",
}

__all__ = ["CONNECTOR_NAME", "VLLMEngineAdapter"]


__getattr__ = kvplug.lazy_exports(__name__, _LAZY)


@kvplug.hookimpl
def kvplug_engine_adapters() -> list[type]:
    from kvplug_vllm.adapter import VLLMEngineAdapter

    return [VLLMEngineAdapter]
