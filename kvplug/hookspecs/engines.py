"""Engine adapter hook: one serving engine's protocol."""

from __future__ import annotations

from kvplug.hookspecs.markers import hookspec


@hookspec
def kvplug_engine_adapters() -> list[type]:
    """Return the engine adapter classes this plugin provides.

    Each class subclasses :class:`kvplug.EngineAdapter` and carries a unique
    ``name: ClassVar[str]`` (``vllm``, ``sglang``) and a pydantic ``Config``.
    The adapter itself is wired into its engine by that engine's own plugin
    mechanism (vLLM ``vllm.general_plugins``, SGLang ``sglang.srt.plugins``);
    this hook lets kvplug list it, report the engine's version and run
    ``kvplug demo`` on the real engine through ``run_demo``.
    """
