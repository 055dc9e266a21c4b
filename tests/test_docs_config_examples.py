"""Every YAML config example in the README, docs/ and the plugins' READMEs loads as written.

A reader copies these blocks into ``kvplug.yaml``: a field name that does not exist, a value
out of range or a key given twice (PyYAML would keep the last silently) must fail here, not
on the reader's server.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvplug import load_config
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "plugins").glob("*/README.md"))]
YAML_BLOCK = re.compile(r"```yaml\n(.*?)```", re.S)
#: Component types an example may name that a plugin outside the core test env provides:
#: the guide's own SQLite tier (docs/writing-plugins.md builds it) and kvplug-cuda (needs CUDA).
ELSEWHERE = {"sqlite", "cuda"}


def _examples() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in YAML_BLOCK.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append((f"{page.relative_to(ROOT)}:{line}", match.group(1)))
    return found


EXAMPLES = _examples()


def test_the_docs_have_config_examples() -> None:
    assert len(EXAMPLES) >= 10, [where for where, _ in EXAMPLES]


@pytest.mark.parametrize(("where", "text"), EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_a_config_example_loads(where: str, text: str, tmp_path: Path) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        loaded = load_config(config_file=path, env={}, registry=PluginRegistry())
    except ConfigError as exc:
        # Only a component type installed elsewhere may fail, and only as not installed.
        unexplained = [p for p in exc.problems if not (p.path.endswith(".type") and p.value in ELSEWHERE)]
        assert not unexplained, f"{where}: {exc}"
        return
    assert loaded.config.tiers, where
