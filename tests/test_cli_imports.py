"""Commands that touch no tensors import neither torch nor an engine.

Each command runs as a user runs it, in a new process, against a real engine's control
server and a real disk store; the process then reports which heavy packages it loaded.
Importing torch costs seconds, which a ``kvplug ctl stats`` must not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug.core.config.loader import load_config
from kvplug.core.control.server import ControlIdentity, ControlServer
from kvplug.core.engine.cache_engine import CacheEngine
from kvplug.core.keys import Fingerprint

#: Packages no such command loads; prometheus_client only where an engine or a remote tier counts.
HEAVY = ("torch", "vllm", "sglang", "triton", "numpy", "prometheus_client")

#: The modules of command groups, each imported only when one of its commands runs.
COMMAND_MODULES = ("kvplug.cli.ctl", "kvplug.cli.store", "kvplug.cli.explain")

#: Runs ``kvplug`` with the given arguments, then writes the heavy packages and command modules it imported.
_RUN = """
import json, sys
from kvplug.cli.main import app
report, *args = sys.argv[1:]
code = 0
try:
    app(args)
except SystemExit as exc:
    code = exc.code
finally:
    heavy = sorted({name.split(".")[0] for name in sys.modules} & set(HEAVY))
    commands = sorted(set(sys.modules) & set(COMMAND_MODULES))
    with open(report, "w") as out:
        json.dump({"exit": code, "heavy": heavy, "commands": commands}, out)
""".replace("COMMAND_MODULES", repr(COMMAND_MODULES)).replace("HEAVY", repr(HEAVY))


@pytest.fixture
def running(tmp_path: Path, socket_dir: Path) -> Iterator[Path]:
    """A running engine (cpu and disk tiers) with a prompt stored; yields the disk store's folder."""
    layout = LAYOUTS["vllm_flash"]
    store = tmp_path / "disk"
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(store), "max_bytes": "64MiB"}]
    extra = {"kvplug": {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}).config
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m")) as engine:
        engine.store(list(range(16)), random_caches(layout, 8), torch.arange(16))
        engine.flush()
        server = ControlServer(engine, ControlIdentity("engine-a", "tiny", "test", tp_rank=0, tp_size=1))
        try:
            yield store
        finally:
            server.close()


def run_reporting(tmp_path: Path, *args: str) -> dict[str, list[str]]:
    """The heavy packages (``heavy``) and command modules (``commands``) ``kvplug ARGS``
    imported; the command must succeed."""
    report = tmp_path / "imported.json"
    done = subprocess.run(
        [sys.executable, "-c", _RUN, str(report), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert report.exists(), f"kvplug {' '.join(args)} did not finish: {done.stderr}"
    assert "Traceback" not in done.stderr, done.stderr
    result = json.loads(report.read_text())
    assert result["exit"] == 0, f"kvplug {' '.join(args)} exited {result['exit']}: {done.stderr}"
    return {"heavy": result["heavy"], "commands": result["commands"]}


def test_commands_that_touch_no_tensors_import_no_torch_nor_engine(running: Path, tmp_path: Path) -> None:
    prompt = tmp_path / "prompt.json"
    prompt.write_text(json.dumps(list(range(16))))
    config = tmp_path / "kvplug.yaml"
    config.write_text(
        f"chunk_size: 8\ntiers: [{{type: cpu, max_bytes: 64MiB}}, {{type: disk, path: {tmp_path / 'd2'}}}]\n"
    )
    commands = [
        ("--help",),
        ("plugins",),
        ("ctl", "list"),
        ("ctl", "stats"),
        ("ctl", "tiers"),
        ("ctl", "lookup", str(prompt)),
        ("ctl", "explain", str(prompt)),
        ("ctl", "pin", str(prompt)),
        ("ctl", "unpin", str(prompt)),
        ("ctl", "clear", "--all"),
        ("config", "validate", str(config)),
        ("config", "show", "--file", str(config)),
        ("store", "stats", str(running)),
        ("store", "ls", str(running)),
        ("store", "verify", str(running)),
        ("store", "gc", str(running)),
    ]
    reports = {" ".join(args): run_reporting(tmp_path, *args) for args in commands}
    # Opening a store's record tier sets up its remote-call counters.
    counting = {command: ["prometheus_client"] if command.startswith("store") else [] for command in reports}
    assert {command: report["heavy"] for command, report in reports.items()} == counting
    # A command imports its own group's module only; --help lists (so imports) them all.
    own = {
        command: sorted(module for module in COMMAND_MODULES if module.endswith("." + command.split()[0]))
        for command in reports
    }
    own["--help"] = sorted(COMMAND_MODULES)
    assert {command: report["commands"] for command, report in reports.items()} == own
