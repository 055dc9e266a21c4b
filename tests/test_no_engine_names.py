"""The core knows no engine: engine adapters declare their KV layout as a kvplug.PagedFormat.

Engine names in kvplug/core or kvplug/builtins mean engine knowledge crept back into the
core (a layout branch, a special case); put it in the engine's plugin instead.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINE_NAMES = re.compile(r"vllm|sglang", re.IGNORECASE)

#: Mentions that predate this test, in files other work owns; each is to be removed, not added to.
KNOWN = {
    ("kvplug/core/plugins.py", '("engine_adapter", "vllm"): "kvplug-vllm",'),
    ("kvplug/core/plugins.py", '("engine_adapter", "sglang"): "kvplug-sglang",'),
    ("kvplug/core/connector.py", "#: One layer's cache as the engine holds it: a tensor, or SGLang's (k, v) pair."),
    (
        "kvplug/core/config_loader.py",
        '"KVPLUG_LOOKUP_DIR",  # kvplug-vllm\'s private lookup-socket folder, exported to its engine processes',
    ),
    ("kvplug/core/components.py", '"""Describes one serving engine\'s integration (vLLM, SGLang).'),
    ("kvplug/core/tier_chain.py", "(vLLM loads the latter asynchronously)."),
    ("kvplug/core/keys.py", "#: KV cache dtype as the engine spells it, an attention kernel's packing (vLLM's CPU"),
}


def engine_mentions() -> list[str]:
    found = []
    for folder in ("kvplug/core", "kvplug/builtins"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            relative = path.relative_to(ROOT).as_posix()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                if ENGINE_NAMES.search(line) and (relative, line.strip()) not in KNOWN:
                    found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_core_and_builtins_name_no_engine() -> None:
    found = engine_mentions()
    assert not found, "engine names in the core (declare engine facts in the engine's plugin):\n" + "\n".join(found)


def test_demo_uses_a_neutral_layout() -> None:
    demo = (ROOT / "kvplug" / "cli" / "demo.py").read_text(encoding="utf-8")
    assert not re.search(r"vllm_|sglang_", demo, re.IGNORECASE)
