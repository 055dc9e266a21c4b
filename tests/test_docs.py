"""The docs keep up with the code: every hook documented, the plugin guide's package works."""

from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvplug.hookspecs import SPEC_MODULES

ROOT = Path(__file__).resolve().parents[1]


def test_every_hook_spec_is_documented() -> None:
    documented = set(re.findall(r"^## (kvplug_\w+)$", (ROOT / "docs" / "hooks.md").read_text(), re.M))
    specs = {
        name
        for module in SPEC_MODULES
        for name, _ in inspect.getmembers(module, inspect.isfunction)
        if name.startswith("kvplug_")
    }
    assert specs == documented
    for module in SPEC_MODULES:
        for name, fn in inspect.getmembers(module, inspect.isfunction):
            if name.startswith("kvplug_"):
                assert inspect.getdoc(fn), f"hook spec {name} has no docstring"


def test_the_plugin_api_page_lists_exactly_the_public_names() -> None:
    import kvplug

    page = (ROOT / "docs" / "api.md").read_text()
    rows = [line for line in page.split("## Names in `kvplug`", 1)[1].splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in re.findall(r"`(\w+)`", row.split("|")[1])}
    exported = set(kvplug.__all__)
    assert exported - documented == set(), "public names missing from docs/api.md"
    assert documented - exported == set(), "docs/api.md lists names kvplug does not export"


def test_the_api_reference_renders_exactly_the_public_names() -> None:
    import kvplug

    page = (ROOT / "docs" / "reference.md").read_text()
    rendered = set(re.findall(r"^::: kvplug\.(\w+)$", page, re.M)) - {"errors"}
    assert rendered == set(kvplug.__all__) - {"__version__"}


def test_every_public_name_resolves_and_nothing_else_is_exported() -> None:
    import kvplug

    for name in kvplug.__all__:
        assert getattr(kvplug, name) is not None
    for internal in ("LoopThread", "FrequencySketch", "KeyBuilder", "pack_record", "EngineMetrics"):
        assert internal not in kvplug.__all__
        with pytest.raises(AttributeError):
            getattr(kvplug, internal)


def extract_guide_package(target: Path) -> Path:
    """Write the files that docs/writing-plugins.md marks with ``<!-- file: ... -->``."""
    text = (ROOT / "docs" / "writing-plugins.md").read_text()
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)\n```", text, re.S)
    assert len(blocks) == 4, [name for name, _ in blocks]
    for name, body in blocks:
        path = target / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body + "\n")
    return target / "kvplug-sqlite"


def test_the_guide_plugin_installs_and_is_used_by_name(tmp_path: Path) -> None:
    """The guide's record tier: installed, listed, used by name from a config by two engines,
    inspected by ``kvplug store``, and its conformance test (``StorageTierContract``) run."""
    package = extract_guide_package(tmp_path / "src")
    # What the guide promises: a complete record tier in under 120 lines.
    assert len((package / "kvplug_sqlite" / "tier.py").read_text().splitlines()) < 120
    site = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--target",
            str(site),
            str(package),
        ],
        check=True,
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    env.pop("KVPLUG_PLUGINS", None)
    kvplug_cli = [sys.executable, "-m", "kvplug.cli.main"]

    listing = subprocess.run([*kvplug_cli, "plugins"], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert "kvplug-sqlite" in listing.stdout and "storage_tier: sqlite" in listing.stdout

    db = tmp_path / "kv.db"
    use = f"""
import torch
from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config
config = load_config(engine_extra={{"kvplug": {{"chunk_size": 4, "store": {{"queue": {{"mode": "sync"}}}},
    "tiers": [{{"type": "sqlite", "path": {str(db)!r}, "max_bytes": "1MiB"}}]}}}}, env={{}}).config
layout = KVLayout(PagedFormat("sglang_mha", ("slot", "head", "dim"), tensors=2), 2, 1, 2, 4, torch.float32)
caches = [(torch.randn(32, 2, 4), torch.randn(32, 2, 4)) for _ in range(2)]
with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m")) as engine:
    engine.store(list(range(8)), caches, torch.arange(8))
with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m")) as engine:
    assert engine.lookup(list(range(8))) == 8
    fresh = [(torch.zeros(32, 2, 4), torch.zeros(32, 2, 4)) for _ in range(2)]
    assert engine.retrieve(list(range(8)), fresh, torch.arange(8) + 16).all()
    assert all(torch.equal(a[0][:8], b[0][16:24]) and torch.equal(a[1][:8], b[1][16:24]) for a, b in zip(caches, fresh))
print("sqlite tier used by name: ok")
"""
    used = subprocess.run([sys.executable, "-c", use], env=env, capture_output=True, text=True, timeout=120)
    assert used.returncode == 0, used.stderr
    assert "ok" in used.stdout

    # Another process lists the file, reads and verifies its records (kvplug store, through the base):
    # both chunks and the engine's fingerprint manifest (kvplug explain's).
    verified = subprocess.run(
        [*kvplug_cli, "store", "verify", f"sqlite://{db}"], env=env, capture_output=True, text=True, timeout=120
    )
    assert verified.returncode == 0, verified.stderr
    assert re.search(r"\bok\W+3\b", verified.stdout), verified.stdout

    misspelled = subprocess.run(
        [*kvplug_cli, "config", "validate", str(_write(tmp_path / "bad.yaml", "tiers: [{type: sqlite, paht: x}]\n"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert misspelled.returncode == 2
    assert "tiers[0].paht: unknown key; did you mean 'path'? allowed:" in " ".join(misspelled.stderr.split())

    contract = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(package / "tests")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert contract.returncode == 0, contract.stdout[-3000:]
    assert "passed" in contract.stdout


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_every_setting_is_in_the_config_reference() -> None:
    from kvplug.core.config.model import KVPlugConfig, StoreSettings

    text = (ROOT / "docs" / "config.md").read_text()
    for name in KVPlugConfig.model_fields:
        assert f"| `{name}` |" in text, name
    for name in StoreSettings.model_fields:
        assert f"| `store.{name}` |" in text, name


def test_config_reference_is_up_to_date() -> None:
    import runpy

    render = runpy.run_path(str(ROOT / "docs" / "gen_config_reference.py"))["render"]
    assert (ROOT / "docs" / "config.md").read_text() == render(), (
        "run: python docs/gen_config_reference.py > docs/config.md"
    )
