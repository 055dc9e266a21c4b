"""The plugins' test kits ship in their packages, like ``kvplug.testing``: ``kvplug_valkey.testing``
and ``kvplug_s3.testing`` (and their ``fault_proxy``) and ``kvplug_mooncake.testing`` start real servers for the tests and benchmarks of every package
(core, the other plugins, benchmarks/). Nothing at runtime may import them: not the entry points
kvplug loads, nor any other module of those packages."""

from __future__ import annotations

import json
import subprocess
import sys

CHECK = """
KITS = {"testing", "fault_proxy"}
import importlib, json, pkgutil, sys
from kvplug import PluginRegistry
from kvplug.core.concerns import CONCERNS
registry = PluginRegistry()
for concern in CONCERNS:
    registry.components(concern.key)
loaded = sorted(info.name for info in registry.plugins())
for package in ("kvplug_valkey", "kvplug_mooncake", "kvplug_s3"):
    module = importlib.import_module(package)
    for info in pkgutil.iter_modules(module.__path__, package + "."):
        if info.name.rsplit(".", 1)[-1] not in KITS:
            importlib.import_module(info.name)
kits = sorted(m for m in sys.modules if m.split(".")[-1] in KITS and m.startswith("kvplug"))
print(json.dumps({"plugins": loaded, "kits": kits}))
"""


def test_no_runtime_module_imports_a_test_kit() -> None:
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert {"valkey", "mooncake", "s3"} <= set(found["plugins"])  # their entry points were loaded
    assert found["kits"] == []
