"""The distribution: ``pip install kvplug-valkey`` needs only kvplug and valkey-py; the tier never imports torch."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import requires


def test_runtime_requirements_are_kvplug_and_valkey_only() -> None:
    runtime = [r for r in requires("kvplug-valkey") or [] if "extra ==" not in r]
    names = sorted(re.split(r"[ <>=!~;\[]", r, maxsplit=1)[0].lower() for r in runtime)
    assert names == ["kvplug", "valkey"], runtime


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = "import sys, kvplug_valkey; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False"
