"""kvplug's view of the vLLM integration: engine adapter ``vllm``."""

from __future__ import annotations

from typing import Any, ClassVar

from kvplug import EngineAdapter
from kvplug_vllm.identity import vllm_version


class VLLMEngineAdapter(EngineAdapter):
    """vLLM v1 through ``KVPlugConnector``; ``kvplug demo`` runs a real engine with it."""

    name: ClassVar[str] = "vllm"
    engine_distribution: ClassVar[str] = "vllm"
    #: the private lookup-socket folder, exported to vLLM's engine processes (kvplug.private_socket_dir)
    environment: ClassVar[tuple[str, ...]] = ("KVPLUG_LOOKUP_DIR",)

    @classmethod
    def engine_version(cls) -> str | None:
        return vllm_version()

    @classmethod
    def run_demo(cls, console: Any, **options: Any) -> dict[str, Any] | None:
        if cls.engine_version() is None:
            return None
        from kvplug_vllm.demo import run_engine_demo

        return run_engine_demo(console, tokens=int(options.get("tokens", 4096)))
