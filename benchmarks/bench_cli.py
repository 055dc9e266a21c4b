"""How long ``kvplug`` commands take, as a user runs them (a new process each time).

    python benchmarks/bench_cli.py              # a table (core env: nox -s core's venv)
    python benchmarks/bench_cli.py --json       # ... and one JSON object as the last line

Against a real engine's control server (cpu and disk tiers, in this process) and the disk
store it wrote: ``kvplug ctl list|stats|tiers|lookup|explain|pin|unpin``, ``kvplug plugins``, ``kvplug config
validate|show``, ``kvplug store stats|ls|verify`` and ``--help``. Each command's median
wall time over ``--reps`` runs, taken in turn with the baselines of the same run: ``python
-c pass`` (the interpreter alone) and ``python -c "import torch"`` (what a command that
imported torch would pay at least). Goal: every command under 0.5 s; nothing is asserted.

Each command runs once untimed first, with bytecode writing allowed: an installed kvplug
has its bytecode (pip compiles it at install; a source checkout writes it on its first
run). Without it (``PYTHONDONTWRITEBYTECODE`` set in a fresh checkout) every command
compiles kvplug's modules again, about 0.15 s more on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from kvplug.core.config.loader import load_config
from kvplug.core.control.server import ControlIdentity, ControlServer
from kvplug.core.engine.cache_engine import CacheEngine
from kvplug.core.keys import Fingerprint
from kvplug.core.layouts import KVLayout, PagedFormat

BASELINES = {"python -c pass": ["-c", "pass"], "python -c 'import torch'": ["-c", "import torch"]}


def wall_time(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=300)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} exited {done.returncode}: {done.stderr}")
    return elapsed


def commands(folder: Path, store: Path) -> dict[str, list[str]]:
    prompt = folder / "prompt.json"
    prompt.write_text(json.dumps(list(range(64))))
    config = folder / "kvplug.yaml"
    config.write_text(f"tiers: [{{type: cpu, max_bytes: 64MiB}}, {{type: disk, path: {folder / 'other'}}}]\n")
    named = {
        "--help": ["--help"],
        "plugins": ["plugins"],
        "ctl list": ["ctl", "list"],
        "ctl stats": ["ctl", "stats"],
        "ctl tiers": ["ctl", "tiers"],
        "ctl lookup": ["ctl", "lookup", str(prompt)],
        "ctl explain": ["ctl", "explain", str(prompt)],
        "ctl pin": ["ctl", "pin", str(prompt)],
        "ctl unpin": ["ctl", "unpin", str(prompt)],
        "config validate": ["config", "validate", str(config)],
        "config show": ["config", "show", "--file", str(config)],
        "store stats": ["store", "stats", str(store)],
        "store ls": ["store", "ls", str(store)],
        "store verify": ["store", "verify", str(store)],
    }
    return {name: ["-m", "kvplug.cli.main", *args] for name, args in named.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="Runs of each command (median).")
    parser.add_argument("--json", action="store_true", help="Also print one JSON object as the last line.")
    options = parser.parse_args()
    out = sys.stderr if options.json else sys.stdout

    folder = Path(tempfile.mkdtemp(prefix="kvcli-"))
    env = {**os.environ, "KVPLUG_LOOKUP_DIR": str(folder), "COLUMNS": "200"}
    os.environ["KVPLUG_LOOKUP_DIR"] = str(folder)
    layout = KVLayout(
        PagedFormat("flash", ("kv", "block", "token", "head", "dim")),
        num_layers=4,
        block_size=16,
        num_kv_heads=4,
        head_dim=64,
        dtype=torch.float16,
    )
    store = folder / "disk"
    tiers = [{"type": "cpu", "max_bytes": "256MiB"}, {"type": "disk", "path": str(store), "max_bytes": "256MiB"}]
    extra = {"kvplug": {"chunk_size": 16, "store": {"queue": {"mode": "sync"}}, "tiers": tiers}}
    config = load_config(engine_extra=extra, env={}).config
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="bench")) as engine:
        caches = [torch.randn(layout.cache_shape(8), dtype=torch.float16) for _ in range(layout.num_layers)]
        engine.store(list(range(64)), caches, torch.arange(64))
        engine.flush()
        server = ControlServer(engine, ControlIdentity("bench", "bench", "bench", tp_rank=0, tp_size=1))
        try:
            runs = {**BASELINES, **commands(folder, store)}
            writes_bytecode = {k: v for k, v in env.items() if k != "PYTHONDONTWRITEBYTECODE"}
            for args in runs.values():
                wall_time(args, writes_bytecode)
            times: dict[str, list[float]] = {name: [] for name in runs}
            for _ in range(options.reps):  # in turn: a slow moment of the machine hits every command alike
                for name, args in runs.items():
                    times[name].append(wall_time(args, env))
        finally:
            server.close()

    medians = {name: statistics.median(samples) for name, samples in times.items()}
    base = medians["python -c pass"]
    print(f"{'command':<28} {'median s':>9} {'over python -c pass':>20}", file=out)
    for name, median in medians.items():
        print(f"{name:<28} {median:9.3f} {median - base:20.3f}", file=out)
    slowest = max((m, n) for n, m in medians.items() if n not in BASELINES)
    print(f"slowest command: {slowest[1]} {slowest[0]:.3f} s (goal: < 0.5 s)", file=out)
    if options.json:
        print(
            json.dumps(
                {"reps": options.reps, "median_s": medians, "over_python_s": {n: m - base for n, m in medians.items()}}
            )
        )


if __name__ == "__main__":
    main()
