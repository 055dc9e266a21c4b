"""The README's GPU table from a ``gpu_check.py`` results file.

    python benchmarks/gpu_table.py benchmarks/results/gpu_check-<device>-<utc>.json

Prints a Markdown table: each figure with the same run's baseline and the ratio, under a
line saying where and with what it ran (device, driver, torch, Triton, commit, tests).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def table(result: dict[str, Any]) -> str:
    """Markdown for one results file (``gpu_check.py``'s JSON)."""
    env = result["environment"]
    tests = result.get("tests", {})
    ran = (
        f"tests: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"
        if "passed" in tests
        else f"tests: {tests.get('skipped') or tests.get('error') or 'not run'}"
    )
    smoke = " **smoke run on CPU: the figures mean nothing**" if result.get("smoke_cpu") else ""
    lines = [
        f"{env['device']}, driver {env.get('driver') or 'n/a'}, CUDA {env.get('cuda') or 'n/a'}, torch {env['torch']}, "
        f"Triton {env.get('triton')}; commit {str(env.get('git_commit') or 'n/a')[:10]}, {result['started_utc']}; "
        f"{ran}.{smoke}",
        "",
        "| what | path | direction | GB/s | baseline | baseline GB/s | ratio |",
        "|---|---|---|---:|---|---:|---:|",
    ]
    for row in result["figures"]:
        lines.append(
            f"| {row['what']} | {row['path']} | {row['direction']} | {row['gbps']:.2f} | {row['baseline']} | "
            f"{row['baseline_gbps']:.2f} | {row['ratio']:.2f} |"
        )
    failed = [b["name"] for b in result.get("benchmarks", []) if "error" in b]
    if "error" in result.get("engine", {}):
        failed.append("engine")
    if failed:
        lines += ["", f"Did not complete: {', '.join(failed)} (see the results file)."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, help="a gpu_check.py results file")
    args = parser.parse_args(argv)
    sys.stdout.write(table(json.loads(args.results.read_text())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
