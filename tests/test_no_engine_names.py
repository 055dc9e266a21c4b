"""The core knows no engine: engine adapters declare their KV layout as a kvplug.PagedFormat.

Engine names in kvplug/core or kvplug/builtins mean engine knowledge crept back into the
core (a layout branch, a special case); put it in the engine's plugin instead.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_NAMES = re.compile(r"vllm|sglang", re.IGNORECASE)


def engine_mentions() -> list[str]:
    found = []
    for folder in ("kvplug/core", "kvplug/builtins"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if ENGINE_NAMES.search(line):
                    found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_core_and_builtins_name_no_engine() -> None:
    found = engine_mentions()
    assert not found, "engine names in the core (declare engine facts in the engine's plugin):\n" + "\n".join(found)


def test_demo_uses_a_neutral_layout() -> None:
    demo = (ROOT / "kvplug" / "cli" / "demo.py").read_text(encoding="utf-8")
    assert not re.search(r"vllm_|sglang_", demo, re.IGNORECASE)
