"""Install hints: a config naming a component of kvplug's that is not installed says which
package provides it, for every component a plugin under plugins/ ships, on one line."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvplug import load_config
from kvplug.core.concerns import CONCERNS, CONFIG_CONCERNS
from kvplug.core.plugins import PluginRegistry
from kvplug.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
HOOKS = {concern.hook: concern.key for concern in CONCERNS}


def _class_name(tree: ast.Module, class_name: str) -> str | None:
    """The ``name = "..."`` class attribute of ``class_name`` in a module's source."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for statement in node.body:
                target = getattr(statement, "target", None) or (getattr(statement, "targets", None) or [None])[0]
                value = getattr(statement, "value", None)
                if isinstance(target, ast.Name) and target.id == "name" and isinstance(value, ast.Constant):
                    return str(value.value)
    return None


def shipped_components() -> list[tuple[str, str, str]]:
    """``(concern, component name, distribution)`` of every component the plugins under
    plugins/ provide, read from their sources (no plugin is imported: most are not
    installed in any one test environment)."""
    found = []
    for pyproject in sorted(ROOT.glob("plugins/*/pyproject.toml")):
        # No tomllib on Python 3.10: the two things read are plain lines of these files.
        text = pyproject.read_text(encoding="utf-8")
        distribution = re.search(r'^name = "([^"]+)"$', text, re.M)
        section = re.search(r"^\[project\.entry-points\.kvplug\]\n(.*?)(?:^\[|\Z)", text, re.M | re.S)
        assert distribution and section, f"{pyproject}: no project name or kvplug entry points"
        for module in re.findall(r'^\w+ = "([\w.]+)"$', section.group(1), re.M):
            package_dir = pyproject.parent / module.replace(".", "/")
            init = ast.parse((package_dir / "__init__.py").read_text(encoding="utf-8"))
            imported = {
                alias.asname or alias.name: node.module
                for node in ast.walk(init)  # in the hook functions too: plugins import their classes there
                if isinstance(node, ast.ImportFrom) and node.module
                for alias in node.names
            }
            for function in init.body:
                if not isinstance(function, ast.FunctionDef) or function.name not in HOOKS:
                    continue
                returned = [n.value for n in ast.walk(function) if isinstance(n, ast.Return)]
                classes = [e.id for r in returned if isinstance(r, ast.List) for e in r.elts if isinstance(e, ast.Name)]
                for class_name in classes:
                    source = ROOT / "plugins" / pyproject.parent.name / (imported[class_name].replace(".", "/") + ".py")
                    name = _class_name(ast.parse(source.read_text(encoding="utf-8")), class_name)
                    assert name, f"{source}: class {class_name} has no literal name"
                    found.append((HOOKS[function.name], name, distribution.group(1)))
    return found


SHIPPED = shipped_components()
CHOSEN_BY_CONFIG = [c for c in SHIPPED if c[0] in {concern.key for concern in CONFIG_CONCERNS}]


def test_the_plugins_are_read() -> None:
    names = {(concern, name) for concern, name, _ in SHIPPED}
    # a reader that finds nothing would make the tests below pass vacuously
    assert {("storage_tier", "mooncake"), ("serializer", "zstd"), ("kv_connector", "native")} <= names
    assert len(CHOSEN_BY_CONFIG) >= 11


def test_every_shipped_component_has_an_install_hint_naming_its_distribution() -> None:
    table = {(concern.key, name): package for concern in CONCERNS for name, package in concern.known.items()}
    missing = [(c, n, d) for c, n, d in CHOSEN_BY_CONFIG if table.get((c, n)) != d]
    assert not missing, f"add these to kvplug.core.concerns.CONCERNS (concern, name, package): {missing}"
    stale = set(table) - {(c, n) for c, n, _ in SHIPPED}
    assert not stale, f"kvplug.core.concerns.CONCERNS names components no plugin ships: {stale}"


@pytest.mark.parametrize(("concern", "name", "package"), CHOSEN_BY_CONFIG, ids=[c[1] for c in CHOSEN_BY_CONFIG])
def test_a_config_naming_an_uninstalled_component_says_what_to_install(concern: str, name: str, package: str) -> None:
    entry = {"type": name}
    field = {"serializer": "kvplug.serializer", "kv_connector": "kvplug.connector", "storage_tier": "kvplug.tiers"}
    value = [entry] if concern == "storage_tier" else entry
    with pytest.raises(ConfigError) as info:
        load_config(registry=PluginRegistry(load_entry_points=False), env={}, engine_extra={field[concern]: value})
    assert f"needs the {package} package: pip install {package}" in str(info.value)


def test_a_hint_printed_through_a_pipe_keeps_its_command_on_one_line(tmp_path: Path) -> None:
    # A long path puts the hint past column 80, where rich wraps when stderr is not a terminal.
    config = tmp_path / ("a-config-folder-with-a-long-name-" * 3) / "kvplug.yaml"
    config.parent.mkdir()
    config.write_text("serializer: {type: zstd}\ntiers: [{type: mooncake}, {type: s3, url: 's3://bucket/prefix'}]\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["KVPLUG_PLUGINS"] = ""  # no entry points: every plugin's component is "not installed"
    result = subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", "config", "validate", str(config)],
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    for package in ("kvplug-compress", "kvplug-mooncake", "kvplug-s3"):
        assert any(f"needs the {package} package: pip install {package}" in line for line in lines), result.stderr
    assert max(len(line) for line in lines) > 80  # the test shows what it claims: long lines, kept whole
