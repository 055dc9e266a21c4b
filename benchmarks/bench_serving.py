"""A serving workload against real vLLM OpenAI servers, with and without kvplug (issue 33).

Each configuration is its own OpenAI server on 127.0.0.1 (``vllm_miss_overhead.openai_server``),
started once per workload and warmed up with one request; requests go to one server at a
time, the others stopped (SIGSTOP of their process groups). Every server has prefix caching
on, the same ``--num-gpu-blocks-override`` (by default a third of the workload's distinct
context, at least room for the requests in flight, so vLLM's own cache is under pressure;
``--no-pressure``: room for all of it) and the same ``VLLM_CPU_NUM_OF_RESERVED_CPU``.
Configurations:

* ``A`` vLLM alone; ``A2`` a second one (the A/A control: how far apart two servers are);
* ``B`` kvplug, a cpu tier holding everything; ``C`` kvplug, a small cpu tier (a quarter
  of the context) over a disk tier in the work folder;
* ``F``, ``S`` and ``L`` (the scan comparison, issue 33 item 6): one cpu tier of 1.1x the
  workload's context, ``admission: frequency, min_hits: 2`` + ``eviction: s3fifo`` (F),
  admit-all + ``s3fifo`` (S), against admit-all + ``lru`` (L, kvplug's defaults: the
  baseline of this comparison), on the multi-round workload with a one-off prompt after
  every ``--scan-every`` requests.

Workloads (``serving_workloads.py``): ``multiround`` (users sharing a system prompt, each
with its own document, rounds of question + answer, users round-robin; each round's prompt
holds the earlier rounds' questions and the server's answers) and ``longdoc`` (documents
times questions, each document revisited after all the others). Token ids are seeded
random ids; each repetition draws a new workload (seed ``<workload>-rep<i>``), the same
for every configuration, so nothing is shared across repetitions, and each run starts
with ``POST /reset_prefix_cache?reset_external=true`` (the servers run with
``VLLM_SERVER_DEV_MODE=1``), which empties vLLM's prefix cache and kvplug's memory tiers
(without ``reset_external`` vLLM leaves the connector alone: an s3fifo tier then started
each repetition with the last one's hot chunks in its main queue). Repetitions are interleaved:
every configuration once per repetition, the order rotated each time.

Per run: TTFT p50/p90/p99 (client side, streamed), the largest gap between two tokens,
wall time, output tokens/s, kvplug's hit and loaded tokens (and hit tokens by tier) and
its lookup/load/store seconds (the change of its counters on vLLM's ``/metrics``), and
vLLM's prefix-cache hits. Each figure is a median over repetitions with its ratio to the
baseline, the first configuration listed (A; L in the scan comparison): median, min-max
over repetitions. Outputs are compared with the baseline's same request: a request whose
prompt differs (an earlier answer differed) is a follow-on; a differing output is counted
with whether the request had more cached prompt tokens (the usage's ``cached_tokens``: vLLM's
cache plus kvplug's) than under the baseline (its prefix came from kvplug: a near-tie flip
of a random bf16 model, whose KV was computed in a different split) or not. The slowest requests
are listed with the server's per-request queue time and scheduled-to-first-token time
(``--enable-per-request-metrics``). ``--json`` prints one JSON object as the last line.

    .nox/vllm/bin/python benchmarks/bench_serving.py [--quick] [--workloads multiround,longdoc]
        [--configs A,B,C,A2] [--reps 3] [--scan-configs L,F] [--scan-reps 2] [--no-pressure] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from kvplug_vllm.tiny_model import BENCH_SPEC, write_random_llama

sys.path.insert(0, str(Path(__file__).parent))
from serving_workloads import Request, Result, Sizes, Workload, longdoc, multiround, play
from vllm_miss_overhead import Server, _free_port, openai_server

CHUNK_SIZE = 256
BLOCK_SIZE = 32  # vLLM CPU attention: a multiple of 32
#: The issue's model: BENCH_SPEC with 3 layers (about 500 prefill tokens/s on the 2-core VM under load).
SPEC = dataclasses.replace(BENCH_SPEC, num_hidden_layers=3)
KV_BYTES_PER_TOKEN = SPEC.num_hidden_layers * 2 * SPEC.num_key_value_heads * SPEC.head_dim * 2
QUICK = Sizes(users=4, system=128, document=512, rounds=2, question=16, answer=4, concurrency=2,
              documents=3, questions=2, scan_every=2)  # fmt: skip
DESCRIPTIONS = {
    "A": "vLLM alone",
    "A2": "vLLM alone (control)",
    "B": "kvplug cpu",
    "C": "kvplug small cpu + disk",
    "F": "cpu, frequency + s3fifo",
    "L": "cpu, admit-all + lru",
    "S": "cpu, admit-all + s3fifo",
}
RATIO_KEYS = ["ttft_p50", "ttft_p90", "ttft_p99", "max_gap", "wall_s", "tok_s"]


def tiers(config: str, workload: Workload, workdir: Path) -> list[dict[str, Any]] | None:
    """kvplug's tiers of a configuration (None: no connector)."""
    context = workload.distinct_tokens * KV_BYTES_PER_TOKEN
    if config in ("A", "A2"):
        return None
    if config == "B":
        return [{"type": "cpu", "max_bytes": max(4 * context, 256 << 20)}]
    if config == "C":
        disk = {"type": "disk", "path": str(workdir / f"disk-{workload.name}"), "max_bytes": max(4 * context, 1 << 30)}
        return [{"type": "cpu", "max_bytes": context // 4}, disk]
    if config == "F":
        return [{"type": "cpu", "max_bytes": int(1.1 * context), "eviction": "s3fifo",
                 "admission": {"type": "frequency", "min_hits": 2}}]  # fmt: skip
    if config == "S":
        return [{"type": "cpu", "max_bytes": int(1.1 * context), "eviction": "s3fifo"}]
    if config == "L":
        return [{"type": "cpu", "max_bytes": int(1.1 * context), "eviction": "lru"}]
    raise SystemExit(f"unknown configuration {config!r}: choose from {', '.join(DESCRIPTIONS)}")


def kv_transfer(config: str, workload: Workload, workdir: Path) -> dict[str, Any] | None:
    chosen = tiers(config, workload, workdir)
    if chosen is None:
        return None
    extra = {"kvplug.chunk_size": CHUNK_SIZE, "kvplug.tiers": chosen}
    return {"kv_connector": "KVPlugConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": extra}  # fmt: skip


def max_model_len(workload: Workload) -> int:
    return workload.longest_prompt + workload.max_tokens + BLOCK_SIZE


def blocks_for(workload: Workload, concurrency: int, pressure: bool, override: int | None) -> int:
    """vLLM's KV cache in blocks: a third of the distinct context, and at least room for the
    requests in flight (else vLLM runs fewer at once and the run measures its queue)."""
    longest = math.ceil(max_model_len(workload) / BLOCK_SIZE) + 1
    if override is not None:
        return max(override, longest)
    context = math.ceil(workload.distinct_tokens / BLOCK_SIZE)
    if not pressure:  # everything, scans and the requests in flight included
        scans = sum(r.scan for r in workload.requests) * longest
        return context + scans + concurrency * longest
    return max(context // 3, concurrency * longest)


#: Series read from vLLM's ``/metrics`` and from the worker's kvplug endpoint (``kvplug.metrics_port``:
#: admission and promotions are counted only there).
SERVER_SERIES = ("kvplug_", "vllm:prefix_cache", "vllm:external_prefix", "vllm:num_preemptions")
WORKER_SERIES = ("kvplug_admission_", "kvplug_promotions")


def metrics(url: str, worker_url: str | None = None) -> dict[str, float]:
    """kvplug's and vLLM's counters, summed over labels except ``tier`` (the worker's: ``worker:`` names)."""
    totals = _series(url, SERVER_SERIES, "")
    return totals if worker_url is None else {**totals, **_series(worker_url, WORKER_SERIES, "worker:")}


def _series(url: str, prefixes: tuple[str, ...], tag: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    totals: dict[str, float] = {}
    for line in lines:
        if line.startswith(prefixes):
            series, value = line.rsplit(" ", 1)
            name = tag + series.split("{")[0]
            if name.endswith("_created"):  # prometheus_client's creation timestamps, not counts
                continue
            if 'tier="' in series:
                name += "." + series.split('tier="')[1].split('"')[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def reset(server: Server) -> None:
    url = server.url + "/reset_prefix_cache?reset_external=true"  # without it vLLM leaves kvplug alone
    with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=120) as response:
        if not json.loads(response.read()).get("success"):
            raise RuntimeError(f"{server.url}: reset_prefix_cache did not succeed")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(results: list[Result], wall: float, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    ttfts = [r.ttft for r in results]
    tokens = sum(len(r.output) for r in results)
    return {
        "ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9), "ttft_p99": percentile(ttfts, 0.99),
        "max_gap": max((g for r in results for g in r.gaps), default=0.0), "wall_s": wall, "tok_s": tokens / wall,
        "requests": len(results), "hit_tokens": delta.get("kvplug_hit_tokens_total", 0.0),
        "loaded_tokens": delta.get("kvplug_loaded_tokens_total", 0.0),
        "hit_by_tier": {k.split(".", 1)[1]: v for k, v in delta.items() if k.startswith("kvplug_hit_tokens_by_tier_total.")},
        "lookup_s": delta.get("kvplug_lookup_seconds_sum", 0.0), "load_s": delta.get("kvplug_load_seconds_sum", 0.0),
        "store_s": delta.get("kvplug_store_seconds_sum", 0.0),
        "vllm_prefix_hits": delta.get("vllm:prefix_cache_hits_total", 0.0),
        "vllm_prefix_queries": delta.get("vllm:prefix_cache_queries_total", 0.0),
        "preemptions": delta.get("vllm:num_preemptions_total", 0.0),
        "admitted": _by_tier(delta, "worker:kvplug_admission_admitted_total."),
        "declined": _by_tier(delta, "worker:kvplug_admission_declined_total."), "metrics_delta": delta,
    }  # fmt: skip


def _by_tier(delta: dict[str, float], prefix: str) -> dict[str, float]:
    return {k[len(prefix) :]: v for k, v in delta.items() if k.startswith(prefix)}


def agreement(runs: list[dict[str, Any]], base: list[dict[str, Any]]) -> dict[str, int]:
    """Requests whose output differs from the baseline's same request (same repetition), by cause."""
    counts = {"compared": 0, "same": 0, "differ_more_cached": 0, "differ_other": 0, "follow_on": 0}
    for run, ref in zip(runs, base):
        reference = {r["key"]: r for r in ref["results"]}
        for mine in run["results"]:
            other = reference[mine["key"]]
            if mine["prompt_digest"] != other["prompt_digest"]:
                counts["follow_on"] += 1  # an earlier answer differed, so this prompt did
                continue
            counts["compared"] += 1
            if mine["output"] == other["output"]:
                counts["same"] += 1
            elif (mine["server"].get("cached_tokens") or 0) > (other["server"].get("cached_tokens") or 0):
                counts["differ_more_cached"] += 1
            else:
                counts["differ_other"] += 1
    return counts


def run_phase(
    model: str, workdir: Path, build: Any, configs: list[str], reps: int, args: argparse.Namespace, out: Any
) -> dict[str, Any]:
    """Start one server per configuration, play ``reps`` interleaved repetitions, return the figures."""
    workloads = [build(f"rep{rep}") for rep in range(reps)]
    first = workloads[0]
    blocks = blocks_for(first, args.concurrency, not args.no_pressure, args.blocks)
    print(f"\n== {first.name}: {len(first.requests)} requests, {first.distinct_tokens} distinct context tokens "
          f"({math.ceil(first.distinct_tokens / BLOCK_SIZE)} blocks of {BLOCK_SIZE}); vLLM's KV cache: {blocks} blocks "
          f"({'no pressure' if args.no_pressure else 'a third of the context, at least room for the requests in flight'}); configs {configs}, {reps} reps", file=out, flush=True)  # fmt: skip
    options = ["--max-num-seqs", str(args.concurrency), "--num-gpu-blocks-override", str(blocks),
               "--block-size", str(BLOCK_SIZE), "--enable-prompt-tokens-details", "--enable-per-request-metrics"]  # fmt: skip
    max_len = max_model_len(first)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    with ExitStack() as stack:
        servers: dict[str, Server] = {}
        worker_urls: dict[str, str] = {}
        for config in configs:
            t0 = time.perf_counter()
            kv = kv_transfer(config, first, workdir)
            if kv is not None:
                port = _free_port()
                kv["kv_connector_extra_config"]["kvplug.metrics_port"] = port
                worker_urls[config] = f"http://127.0.0.1:{port}"
            server = stack.enter_context(openai_server(model, workdir, f"{first.name}-{config}", kv, max_len, options,
                                                       {"VLLM_SERVER_DEV_MODE": "1"}))  # fmt: skip
            warm = random.Random(f"warmup-{config}")
            prompt = [warm.randrange(3, SPEC.vocab_size) for _ in range(512)]
            play(server.url, Workload("warmup", [Request("warmup", lambda _, p=prompt: p)], 0, 0, 2), 1)
            server.pause()
            servers[config] = server
            print(
                f"  server {config} ({DESCRIPTIONS[config]}) up in {time.perf_counter() - t0:.0f}s",
                file=out,
                flush=True,
            )
        for rep, workload in enumerate(workloads):
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for config in order:
                server = servers[config]
                server.resume()
                reset(server)
                before = metrics(server.url, worker_urls.get(config))
                results, wall = play(server.url, workload, args.concurrency)
                time.sleep(1.0)  # the last step's connector stats reach the API server just after its output
                summary = summarize(results, wall, before, metrics(server.url, worker_urls.get(config)))
                server.pause()
                summary["results"] = [dataclasses.asdict(r) for r in results]
                runs[config].append(summary)
                print(f"  rep {rep + 1} {config}: wall {wall:.1f}s, TTFT p50 {summary['ttft_p50']:.3f}s "
                      f"p99 {summary['ttft_p99']:.3f}s, kvplug loaded {summary['loaded_tokens']:.0f} tokens", file=out, flush=True)  # fmt: skip
    return {"workload": first.name, "blocks": blocks, "distinct_tokens": first.distinct_tokens, "runs": runs}


def report(phase: dict[str, Any], out: Any) -> dict[str, Any]:
    """Print a phase's tables; return its figures (medians, ratios to the baseline, agreement, slowest requests)."""
    runs, med = phase["runs"], statistics.median
    figures: dict[str, Any] = {"blocks": phase["blocks"], "distinct_tokens": phase["distinct_tokens"], "configs": {}}
    head = f"{'config':<28}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'max gap':>9}{'wall s':>8}{'tok/s':>7}{'kvplug hit':>11}{'loaded':>8}{'vLLM hit':>9}  hit by tier"
    print(f"\n{phase['workload']} (medians over repetitions; seconds)\n{head}", file=out)
    for config, reps in runs.items():
        m = {
            k: med(r[k] for r in reps)
            for k in [*RATIO_KEYS, "hit_tokens", "loaded_tokens", "vllm_prefix_hits", "lookup_s", "load_s", "store_s"]
        }
        by_tier = {t: med(r["hit_by_tier"].get(t, 0.0) for r in reps) for r in reps for t in r["hit_by_tier"]}
        admission = {
            f"{what} {t}": med(r[what].get(t, 0.0) for r in reps)
            for what in ("admitted", "declined")
            for r in reps
            for t in r[what]
        }
        figures["configs"][config] = {
            "median": m,
            "hit_by_tier": by_tier,
            "admission_chunks": admission,
            "runs": [{k: v for k, v in r.items() if k != "results"} for r in reps],
        }
        print(f"{config + ' ' + DESCRIPTIONS[config]:<28}{m['ttft_p50']:>9.3f}{m['ttft_p90']:>8.3f}{m['ttft_p99']:>8.3f}{m['max_gap']:>9.3f}"
              f"{m['wall_s']:>8.1f}{m['tok_s']:>7.1f}{m['hit_tokens']:>11.0f}{m['loaded_tokens']:>8.0f}{m['vllm_prefix_hits']:>9.0f}  "
              + ", ".join(f"{t} {v:.0f}" for t, v in by_tier.items())
              + "".join(f"; {k} {v:.0f} chunks" for k, v in admission.items()), file=out)  # fmt: skip
    base = next(iter(runs))  # the baseline: the phase's first configuration
    figures["baseline"] = base
    print(
        f"\nratio to {base}: median (min-max over repetitions)\n{'config':<28}"
        + "".join(f"{k:>22}" for k in RATIO_KEYS),
        file=out,
    )
    for config, reps in runs.items():
        if config == base:
            continue
        ratios = {k: [r[k] / a[k] if a[k] else math.nan for r, a in zip(reps, runs[base])] for k in RATIO_KEYS}
        spread = {k: {"median": med(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}
        agree = agreement(reps, runs[base])
        figures["configs"][config].update(ratio_to_baseline=spread, agreement=agree)
        print(
            f"{config + ' ' + DESCRIPTIONS[config]:<28}" + "".join(f"{_spread(s):>22}" for s in spread.values()),
            file=out,
        )
    print(
        f"\noutputs against {base}'s same request (same prompt): same / differ with more cached tokens than {base} / differ otherwise; follow-on: prompt differs",
        file=out,
    )
    for config, values in figures["configs"].items():
        if "agreement" in values:
            a = values["agreement"]
            print(f"  {config}: {a['same']}/{a['compared']} same, {a['differ_more_cached']} differ with more cached, "
                  f"{a['differ_other']} differ otherwise, {a['follow_on']} follow-on", file=out)  # fmt: skip
    print(
        "\nslowest requests (p99 and up, every repetition): client TTFT = the engine's queue + scheduled-to-first-token + the rest (before the engine core read it, busy with a step; HTTP)",
        file=out,
    )
    for config, reps in runs.items():
        slow = []
        for rep, run in enumerate(reps):
            cut = run["ttft_p99"]
            slow += [{"rep": rep, **{k: r[k] for k in ("key", "ttft", "prompt_len", "in_flight")}, **r["server"],
                      "run_lookup_s": run["lookup_s"], "run_load_s": run["load_s"]}
                     for r in run["results"] if r["ttft"] >= cut]  # fmt: skip
        figures["configs"][config]["slowest"] = slow
        for s in slow:
            print(f"  {config} rep {s['rep'] + 1} {s['key']:<8} TTFT {s['ttft']:.3f}s  queue {_ms(s.get('queue_ms'))}  sched->first {_ms(s.get('prefill_ms'))}"
                  f"  cached {s.get('cached_tokens')}/{s['prompt_len']} tokens, {s['in_flight']} in flight; kvplug in the run: lookups {s['run_lookup_s']:.2f}s, loads {s['run_load_s']:.2f}s", file=out)  # fmt: skip
    return figures


def _spread(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


def _ms(value: float | None) -> str:
    return "?" if value is None else f"{value / 1000:.3f}s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition: a smoke run")
    parser.add_argument("--workloads", default="multiround,longdoc")
    parser.add_argument("--configs", default="A,B,C,A2")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 3, --quick 1)")
    parser.add_argument(
        "--scan-configs", default="L,F", help="configurations of the scan comparison, baseline first ('' to skip it)"
    )
    parser.add_argument("--scan-reps", type=int, default=None, help="its repetitions (default 2, --quick 1)")
    parser.add_argument(
        "--blocks", type=int, default=None, help="vLLM's KV cache blocks (default: a third of the context)"
    )
    parser.add_argument("--no-pressure", action="store_true", help="room for the whole context in vLLM's KV cache")
    for f in dataclasses.fields(Sizes):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=None, help=f"default {f.default}")
    parser.add_argument(
        "--json", action="store_true", help="print all figures as one JSON object, last (tables to stderr)"
    )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Sizes()
    sizes = dataclasses.replace(base, **{k: v for k in vars(base) if (v := getattr(args, k)) is not None})
    args.concurrency = sizes.concurrency
    reps = args.reps or (1 if args.quick else 3)
    scan_reps = args.scan_reps or (1 if args.quick else 2)
    out = sys.stderr if args.json else sys.stdout
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the servers are killed on the way out
    builders = {
        "multiround": lambda seed: multiround(sizes, f"multiround-{seed}", SPEC.vocab_size),
        "longdoc": lambda seed: longdoc(sizes, f"longdoc-{seed}", SPEC.vocab_size),
    }
    phases = [(builders[w], args.configs.split(","), reps) for w in args.workloads.split(",") if w]
    if args.scan_configs:
        phases.append(
            (
                lambda seed: multiround(sizes, f"scan-{seed}", SPEC.vocab_size, scan=True),
                args.scan_configs.split(","),
                scan_reps,
            )
        )
    for _, configs, _ in phases:
        for config in configs:
            tiers(config, multiround(QUICK, "check", 10), Path())  # unknown names fail now, not after an hour
    started = time.perf_counter()
    result: dict[str, Any] = {"sizes": dataclasses.asdict(sizes), "model_parameters": SPEC.num_parameters(),
                              "layers": SPEC.num_hidden_layers, "pressure": not args.no_pressure, "workloads": {}}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-serving-") as tmp:
        workdir = Path(tmp)
        model = str(write_random_llama(workdir / "model", SPEC))
        os.sync()
        print(
            f"random Llama {SPEC.num_parameters() / 1e6:.0f}M parameters, {SPEC.num_hidden_layers} layers; {sizes}",
            file=out,
        )
        for build, configs, n in phases:
            phase = run_phase(model, workdir, build, configs, n, args, out)
            result["workloads"][phase["workload"]] = report(phase, out)
            result["workloads"][phase["workload"]]["requests"] = {
                c: [r["results"] for r in runs] for c, runs in phase["runs"].items()
            }
    result["elapsed_s"] = time.perf_counter() - started
    print(f"\ndone in {result['elapsed_s'] / 60:.1f} min", file=out)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
