"""Issue 30's vLLM goal for tier ``shm``: a second engine process's warm TTFT from the shm
tier at most 1.3x the first process's warm TTFT from its own cpu tier.

Run by ``python benchmarks/bench_vllm.py --only shm [--sizes ...] [--reps N] [--shm-dir DIR]``.
Every repetition uses a fresh, private folder for the shm tier (under ``/dev/shm`` unless
``--shm-dir`` names another parent; removed after) and two engine processes, one after
the other, with the same tiers ``[cpu, shm]``:

* process 1: two warm-up prompts (computed), then for each size a warm-up prompt of that
  size (computed and stored) and a fresh prompt twice: cold (computed; stored to its cpu
  tier and, through it, to the shared shm tier), then warm (loaded from its own cpu tier,
  only the last token computed);
* process 2, a new engine process: the same two warm-up prompts (loaded from shm: its
  loads warmed up as process 1's prefills were), then for each size the warm-up prompt of
  that size and the measured prompt, both loaded from the shm tier that process 1 filled
  (mapped, checksum verified over the mapping, scattered from it into vLLM's blocks).

Each process has served a request of the size just before its measured one (process 1 the
cold run of the same prompt, process 2 the warm-up of that size), so neither pays the first
request of a size (buffers of that size allocated and faulted in for the first time) in the
measured TTFT. Without the warm-up of the size, process 2 paid it alone: about 6 ms of
"rest" at 4096 tokens, the first size.

The ratio is process 2's warm TTFT over process 1's, per repetition (the same prompt, the
same machine moments apart), its median and its min-max over the repetitions. The
breakdown of each warm request comes from the connector's own timings (lookup, tier
reads, verify, writes into vLLM's blocks; see bench_vllm.py), plus the request's decode
step (the recompute of the last token) and the rest.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from kvplug_vllm.demo import run_in_subprocess

GOAL = 1.3
PARTS = ("lookup", "tier reads", "verify", "write", "decode")


def measure(
    base: dict[str, Any],
    sizes: list[int],
    reps: int,
    *,
    connector: Callable[[list[dict[str, Any]]], dict[str, Any]],
    request: Callable[[int, int], dict[str, Any]],
    phases: Callable[[dict[str, Any], dict[str, Any]], dict[str, float]],
    shm_parent: str,
    trust_host: bool,
    console: Console,
) -> dict[str, Any]:
    """Both processes' warm TTFTs per size and repetition, their breakdowns, hits and outputs."""
    p1: dict[int, list[float]] = {s: [] for s in sizes}
    p2: dict[int, list[float]] = {s: [] for s in sizes}
    parts: dict[str, dict[int, list[dict[str, float]]]] = {"p1": {s: [] for s in sizes}, "p2": {s: [] for s in sizes}}
    hits: dict[int, list[int]] = {s: [] for s in sizes}
    errors = 0
    differ: list[tuple[int, int]] = []
    for rep in range(reps):
        folder = tempfile.mkdtemp(prefix="kvplug-bench-shm-", dir=shm_parent)
        try:
            tiers = [
                {"type": "cpu", "max_bytes": "2GiB"},
                {"type": "shm", "path": folder, "max_bytes": "4GiB", "trust_host": trust_host},
            ]
            first = run_in_subprocess(
                {**base, "kv": connector(tiers), "requests": [r for s in sizes for r in _sized(request, s, rep, 2)]}
            )
            second = run_in_subprocess(
                {**base, "kv": connector(tiers), "requests": [r for s in sizes for r in _sized(request, s, rep, 1)]}
            )
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        for index, size in enumerate(sizes):
            _, cold, warm = first["requests"][3 * index : 3 * index + 3]
            sized_warmup, loaded = second["requests"][2 * index : 2 * index + 2]
            before = sized_warmup["kvplug"]
            p1[size].append(warm["ttft_s"])
            p2[size].append(loaded["ttft_s"])
            parts["p1"][size].append({**phases(cold["kvplug"], warm["kvplug"]), "decode": warm["decode_step_s"]})
            parts["p2"][size].append({**phases(before, loaded["kvplug"]), "decode": loaded["decode_step_s"]})
            # its cpu tier never held this prompt: every hit token came from shm
            hits[size].append(loaded["kvplug"]["hit_tokens"])
            if loaded["tokens"] != warm["tokens"]:  # both load the prefill's own KV: the same tokens
                differ.append((size, rep))
        errors += second["requests"][-1]["kvplug"]["totals"]["load_error_blocks"]
        console.print(
            f"shm rep {rep + 1}/{reps}: "
            + ", ".join(f"{s}: {p2[s][-1] * 1000:.1f} / {p1[s][-1] * 1000:.1f} ms" for s in sizes)
            + " (process 2 from shm / process 1 from cpu)"
        )
    return {"p1": p1, "p2": p2, "parts": parts, "hits": hits, "load_error_blocks": errors, "outputs_differ": differ}


def _sized(request: Callable[[int, int], dict[str, Any]], size: int, rep: int, times: int) -> list[dict[str, Any]]:
    """A warm-up prompt of ``size`` (another prompt: rep + 500), then the measured one ``times`` times."""
    return [request(size, rep + 500), *(request(size, rep) for _ in range(times))]


def report(found: dict[str, Any], sizes: list[int], console: Console) -> dict[str, Any]:
    """Prints the table and the goal line; returns the JSON summary."""
    med = statistics.median
    table = Table(
        title="Warm TTFT: process 2 from the shm tier process 1 filled vs process 1 from its own cpu tier "
        f"(median of {len(found['p1'][sizes[0]])})"
    )
    for column in ("prompt", "who", "warm TTFT", *PARTS, "rest", "hit tokens", "ratio (min-max)"):
        table.add_column(column, justify="right")
    summary: dict[str, Any] = {"goal": GOAL, "by_size": {}}
    for size in sizes:
        ratios = [b / a for a, b in zip(found["p1"][size], found["p2"][size])]
        entry: dict[str, Any] = {
            "ratio_median": med(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "ratios": ratios,
        }
        for who, label in (("p1", "1: own cpu"), ("p2", "2: shm")):
            ttft = med(found[who][size])
            breakdown = {name: med([b[name] for b in found["parts"][who][size]]) for name in PARTS}
            breakdown["rest"] = ttft - sum(breakdown.values())
            entry[who] = {
                "ttft_ms": ttft * 1000,
                "ttfts_ms": [t * 1000 for t in found[who][size]],
                "breakdown_ms": {k: v * 1000 for k, v in breakdown.items()},
            }
            table.add_row(
                f"{size}",
                label,
                f"{ttft * 1000:.1f} ms",
                *(f"{breakdown[name] * 1000:.1f} ms" for name in (*PARTS, "rest")),
                f"{min(found['hits'][size])}" if who == "p2" else "",
                f"{entry['ratio_median']:.2f}x ({entry['ratio_min']:.2f}-{entry['ratio_max']:.2f})"
                if who == "p2"
                else "",
            )
        entry["p2_hit_tokens_min"] = min(found["hits"][size])
        # kvplug's own part, measured by the connector: far steadier than a TTFT on a busy machine
        entry["connector_ms"] = {
            who: med([sum(b[name] for name in PARTS[:4]) for b in found["parts"][who][size]]) * 1000
            for who in ("p1", "p2")
        }
        summary["by_size"][str(size)] = entry
    console.print(table)
    console.print(
        "connector time of the warm request (lookup + tier reads + verify + write), process 2 from shm vs 1 from cpu: "
        + ", ".join(
            f"{s}: {summary['by_size'][str(s)]['connector_ms']['p2']:.1f} vs {summary['by_size'][str(s)]['connector_ms']['p1']:.1f} ms"
            for s in sizes
        )
    )
    biggest = str(max(sizes))
    worst = max(e["ratio_median"] for e in summary["by_size"].values())
    summary.update(
        ratio=summary["by_size"][biggest]["ratio_median"],
        worst_ratio=worst,
        load_error_blocks=found["load_error_blocks"],
        outputs_differ=found["outputs_differ"],
    )
    console.print(
        f"goal (issue 30) warm TTFT from shm in a second process <= {GOAL}x the first process's from its own cpu tier: "
        + ", ".join(f"{s}: {summary['by_size'][str(s)]['ratio_median']:.2f}x" for s in sizes)
        + f" -> {'met' if worst <= GOAL else 'MISSED'}; load errors {found['load_error_blocks']}; "
        f"process 2's outputs equal process 1's warm ones"
        + (f" except (size, rep) {found['outputs_differ']}" if found["outputs_differ"] else "")
    )
    return summary


def run(
    base: dict[str, Any], sizes: list[int], reps: int, *, shm_parent: str | None, trust_host: bool, **hooks: Any
) -> dict[str, Any]:
    """:func:`measure` then :func:`report`; ``shm_parent`` defaults to /dev/shm."""
    parent = shm_parent or "/dev/shm"
    if not Path(parent).is_dir():
        raise SystemExit(f"--shm-dir {parent}: no such folder (tier shm wants a tmpfs, such as /dev/shm)")
    console: Console = hooks.pop("console")
    console.print(f"tier shm with trust_host: {trust_host}")
    found = measure(base, sizes, reps, shm_parent=parent, trust_host=trust_host, console=console, **hooks)
    return {**report(found, sizes, console), "trust_host": trust_host}
