"""The plugin as kvplug and SGLang see it: adapter, entry points, import hygiene."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import kvplug


def test_kvplug_lists_the_sglang_adapter() -> None:
    registry = kvplug.get_registry()
    adapter = registry.engine_adapters()["sglang"]
    assert issubclass(adapter, kvplug.EngineAdapter)
    assert adapter.engine_version() == "0.5.23"
    assert registry.origin("engine_adapter", "sglang").startswith("kvplug-sglang")


def test_sglang_plugin_entry_point_points_at_register() -> None:
    (ep,) = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvplug"]
    assert ep.value == "kvplug_sglang.plugin:register"


def test_sglang_load_plugins_registers_the_backend_in_a_fresh_process() -> None:
    code = (
        "import warnings; warnings.filterwarnings('ignore');"
        "from sglang.srt.plugins import load_plugins; load_plugins(); load_plugins();"
        "from sglang.srt.mem_cache.registry import registered_radix_cache_backends as r; print(r())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"SGLANG_PLUGINS": "kvplug", **_env()},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "'kvplug'" in out.stdout.strip().splitlines()[-1]


def test_importing_the_plugin_does_not_import_sglang() -> None:
    code = "import sys, kvplug; kvplug.get_registry().engine_adapters(); print('sglang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("KVPLUG_")}
