"""The GPU check: kvplug-cuda's tests, its copy paths and the engine path on one GPU, into one JSON file.

Made for a bare H100/H200 that has torch and Triton but nothing of kvplug installed and
nothing to download from: it runs from a checkout (it puts the checkout and its plugins on
``PYTHONPATH`` itself, and registers the plugins' entry points from a folder it writes).
kvplug's own dependencies that such a machine lacks travel as wheels; ``gpu_check.sh``
fetches them here and installs them there. Every step has a time limit; the whole run
fits in 8 minutes on an H200.

1. ``environment``: device, driver, CUDA, torch, Triton, Python, the checkout's commit;
2. ``tests`` (run last, in the time left): ``pytest plugins/kvplug_cuda/tests`` (the GPU tests run with a GPU);
3. ``benchmarks``: ``bench_cuda.py --json`` per case: a 32-layer x 256-token bf16 chunk of
   vLLM's flash layout (whole-chunk and layer-wise gather/scatter into and out of pageable
   memory and pinned frames), the same for MLA and SGLang's MHA pool, and a step of 64
   blocks of 16 tokens (32 KiB per block, layer and K/V);
4. ``engine``: ``CacheEngine`` with the ``cuda`` connector and the ``cpu`` tier, store then
   retrieve of an 8192-token prompt's KV, checked bit for bit, timed against a pinned
   ``copy_`` of the same bytes each way in the same run.

Every figure is in ``figures`` with its baseline (the same run's pinned ``copy_``) and the
ratio; ``gpu_table.py`` turns the file into the README's table.

    benchmarks/gpu_check.sh fetch                    # here: the wheels of kvplug's dependencies, into .whl/
    benchmarks/gpu_check.sh --out "$OUT/gpu_check.json"   # there, with .whl carried along
    python benchmarks/gpu_check.py [--out benchmarks/results/gpu_check-<device>-<date>.json]
    python benchmarks/gpu_check.py --smoke-cpu --out /tmp/smoke.json   # the same steps on CPU, tiny sizes

``--smoke-cpu`` runs every step on CPU tensors with Triton's interpreter and tiny sizes, to
show the script runs end to end; its figures mean nothing and its baseline is a host copy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: The whole check's budget: each step gets what is left, capped by its own limit.
BUDGET_S = 480.0
SCHEMA = 1

#: (name, bench_cuda arguments): the issue's layouts and sizes on a GPU.
GPU_CASES: list[tuple[str, list[str]]] = [
    ("vllm_flash bf16, 32 layers x 256 tokens", ["--layout", "vllm_flash", "--layers", "32", "--tokens", "256"]),
    ("vllm_mla bf16, 32 layers x 256 tokens", ["--layout", "vllm_mla", "--layers", "32", "--tokens", "256"]),
    ("sglang_mha bf16, 32 layers x 256 tokens", ["--layout", "sglang_mha", "--layers", "32", "--tokens", "256"]),
    ("vllm_flash bf16, 64 blocks of 16 tokens", ["--layout", "vllm_flash", "--layers", "32", "--tokens", "1024"]),
]
SMOKE_CASES: list[tuple[str, list[str]]] = [
    (
        f"{name} (smoke: 2 layers x 32 tokens)",
        [*args[:2], "--layers", "2", "--tokens", "32", "--heads", "2", "--head-dim", "16"],
    )
    for name, args in GPU_CASES
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", type=Path, help="the JSON file (default: benchmarks/results/gpu_check-<device>-<utc>.json)"
    )
    parser.add_argument("--smoke-cpu", action="store_true", help="every step on CPU, tiny sizes: checks the script")
    parser.add_argument("--skip-tests", action="store_true", help="leave out the plugin's tests")
    parser.add_argument("--engine-step", action="store_true", help=argparse.SUPPRESS)  # the engine step's own process
    args = parser.parse_args(argv)
    env = _environment_variables(args.smoke_cpu)
    if args.engine_step:
        print(json.dumps(_engine_step(args.smoke_cpu)))
        return 0
    deadline = time.monotonic() + BUDGET_S
    started = time.monotonic()
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "check": "gpu_check",
        "smoke_cpu": args.smoke_cpu,
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": _describe(env),
    }
    result["tests"] = {"skipped": "--skip-tests"}
    # the figures first: the tests (Triton compiles every kernel variant) get what is left
    result["benchmarks"] = [
        _bench(name, case, env, args.smoke_cpu, _left(deadline, 90))
        for name, case in (SMOKE_CASES if args.smoke_cpu else GPU_CASES)
    ]
    result["engine"] = _run_json(
        [sys.executable, __file__, "--engine-step", *(["--smoke-cpu"] * args.smoke_cpu)], env, _left(deadline, 150)
    )
    if not args.skip_tests:
        result["tests"] = _tests(env, args.smoke_cpu, _left(deadline, 300))
    result["figures"] = figures(result)
    result["seconds"] = round(time.monotonic() - started, 1)
    out = args.out or ROOT / "benchmarks" / "results" / _default_name(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"gpu_check: wrote {out} ({result['seconds']} s)")
    failed = result["tests"].get("returncode", 0) != 0 or any("error" in b for b in result["benchmarks"])
    return 1 if failed or "error" in result["engine"] else 0


# --- the environment ---------------------------------------------------------------------


def _environment_variables(smoke_cpu: bool) -> dict[str, str]:
    """PYTHONPATH with the checkout, its plugins and (if kvplug is not installed) their entry points."""
    paths = [str(ROOT), *sorted(str(p) for p in (ROOT / "plugins").glob("kvplug_*") if p.is_dir())]
    for path in reversed(paths):
        if path not in sys.path:
            sys.path.insert(0, path)
    shim = _entry_point_shim()
    if shim is not None:
        paths.append(shim)
        sys.path.append(shim)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    if smoke_cpu:
        env["TRITON_INTERPRET"] = "1"
        env["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def _entry_point_shim() -> str | None:
    """A folder of dist-info entry points for the plugins the check uses, when they are not installed."""
    from importlib.metadata import entry_points

    names = {ep.name for ep in entry_points(group="kvplug")}
    if {"cpu", "cuda"} <= names:
        return None
    folder = Path(tempfile.mkdtemp(prefix="kvplug-gpu-check-"))
    for plugin in ("cpu", "cuda"):
        info = folder / f"kvplug_{plugin}-0.0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvplug-{plugin}\nVersion: 0.0.0\n")
        (info / "entry_points.txt").write_text(f"[kvplug]\n{plugin} = kvplug_{plugin}\n")
    return str(folder)


def _describe(env: dict[str, str]) -> dict[str, Any]:
    import torch

    described: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "driver": _nvidia_smi("driver_version"),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }
    try:
        import triton

        described["triton"] = triton.__version__
    except ImportError as exc:
        described["triton"] = f"not importable: {exc}"
    return described


def _nvidia_smi(field: str) -> str | None:
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


# --- the steps ---------------------------------------------------------------------------


def _left(deadline: float, cap: float) -> float:
    return max(5.0, min(cap, deadline - time.monotonic()))


def _tests(env: dict[str, str], smoke_cpu: bool, timeout_s: float) -> dict[str, Any]:
    # the smoke run checks the plumbing only (the interpreter runs the whole suite in minutes);
    # this check's own test is left out, it would run the check again
    selection = (
        ["plugins/kvplug_cuda/tests/test_pinned_pool.py"]
        if smoke_cpu
        else ["plugins/kvplug_cuda/tests", "--ignore", "plugins/kvplug_cuda/tests/test_gpu_check.py"]
    )
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", *selection]
    started = time.monotonic()
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return {
            "command": command[2:],
            "returncode": -1,
            "error": f"timed out after {timeout_s:.0f} s",
            "tail": _tail(exc.stdout),
        }
    counts = {
        word: int(number)
        for number, word in re.findall(
            r"(\d+) (passed|failed|skipped|errors?|deselected)", done.stdout.splitlines()[-1] if done.stdout else ""
        )
    }
    return {
        "command": command[2:],
        "returncode": done.returncode,
        "seconds": round(time.monotonic() - started, 1),
        **{word: counts.get(word, 0) for word in ("passed", "failed", "skipped")},
        "tail": _tail(done.stdout + done.stderr),
    }


def _bench(name: str, case: list[str], env: dict[str, str], smoke_cpu: bool, timeout_s: float) -> dict[str, Any]:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_cuda.py"), "--json", *case]
    command += ["--smoke-cpu"] if smoke_cpu else []
    return {"name": name, "args": case, **_run_json(command, env, timeout_s)}


def _run_json(command: list[str], env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    """Run ``command``; its stdout's last line is a JSON object (or an ``error`` says what went wrong)."""
    try:
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        return {"error": f"timed out after {timeout_s:.0f} s", "tail": _tail(exc.stderr)}
    lines = done.stdout.strip().splitlines()
    try:
        parsed = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        parsed = None
    if done.returncode != 0 or not isinstance(parsed, dict):
        return {"error": f"exit status {done.returncode}", "tail": _tail(done.stdout + done.stderr)}
    return parsed


def _tail(text: str | bytes | None, lines: int = 15) -> str:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return "\n".join((text or "").splitlines()[-lines:])


def _engine_step(smoke_cpu: bool) -> dict[str, Any]:
    """Store then retrieve one prompt's KV through CacheEngine (cuda connector, cpu tier) vs pinned copy_."""
    import torch

    from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config

    device = torch.device("cpu" if smoke_cpu else "cuda")
    tokens, layers, heads, dim, block, iters = (64, 2, 2, 16, 16, 1) if smoke_cpu else (8192, 32, 8, 128, 16, 3)
    layout = KVLayout(
        PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim")), layers, block, heads, dim, torch.bfloat16
    )
    nbytes = layout.bytes_per_token() * tokens
    chunk = 16 if smoke_cpu else 256
    extra = {
        "kvplug.chunk_size": chunk,
        "kvplug.store.queue.mode": "sync",
        "kvplug.connector": {"type": "cuda"},
        # room for every round's prompt (records add headers); the engine pins this much host memory
        "kvplug.tiers": [{"type": "cpu", "max_bytes": int(1.25 * (iters + 1) * nbytes) + 2**26}],
    }
    config = load_config(engine_extra=extra, env={}).config
    blocks = tokens // block
    source = [
        torch.randint(0, 2**16, (2, 2 * blocks, block, heads, dim), dtype=torch.int32, device=device)
        .to(torch.int16)
        .view(torch.bfloat16)
        for _ in range(layers)
    ]
    slots = (
        torch.randperm(2 * blocks, device=device)[:blocks, None] * block + torch.arange(block, device=device)
    ).reshape(-1)
    target = [torch.zeros_like(cache) for cache in source]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    stores, loads = [], []
    bit_exact = True
    with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="gpu-check")) as engine:
        connector = engine.connector.name
        for round_ in range(iters + 1):  # round 0 warms up (kernel compilation, pinning)
            prompt = [round_ * tokens + i for i in range(tokens)]
            sync()
            began = time.perf_counter()
            stored = engine.store(prompt, source, slots)
            sync()
            stored_s = time.perf_counter() - began
            began = time.perf_counter()
            loaded = engine.retrieve(prompt, target, slots)
            sync()
            loaded_s = time.perf_counter() - began
            if stored != tokens or not bool(loaded.all()):
                return {"error": f"round {round_}: stored {stored} of {tokens} tokens, loaded {int(loaded.sum())}"}
            used = slots.view(-1, block)[:, 0] // block  # the prompt's blocks
            bit_exact = bit_exact and all(
                torch.equal(s.view(torch.int16)[:, used], t.view(torch.int16)[:, used]) for s, t in zip(source, target)
            )
            for cache in target:
                cache.zero_()
            if round_:
                stores.append(stored_s)
                loads.append(loaded_s)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def timed(fn: Any) -> float:
        fn()
        sync()
        times = []
        for _ in range(iters):
            began = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - began)
        return statistics.median(times)

    d2h = timed(lambda: host.copy_(flat, non_blocking=True))
    h2d = timed(lambda: flat.copy_(host, non_blocking=True))
    store_s, load_s = statistics.median(stores), statistics.median(loads)
    return {
        "connector": connector,
        "tokens": tokens,
        "bytes": nbytes,
        "iters": iters,
        "bit_exact": bit_exact,
        "baseline": "copy_ pinned" if device.type == "cuda" else "copy_ host (smoke)",
        "store_gbps": round(nbytes / store_s / 1e9, 3),
        "retrieve_gbps": round(nbytes / load_s / 1e9, 3),
        "baseline_d2h_gbps": round(nbytes / d2h / 1e9, 3),
        "baseline_h2d_gbps": round(nbytes / h2d / 1e9, 3),
        "store_vs_baseline": round(d2h / store_s, 4),
        "retrieve_vs_baseline": round(h2d / load_s, 4),
    }


# --- the flat list ----------------------------------------------------------------------


def figures(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every figure of ``result`` as {what, path, direction, gbps, baseline, baseline_gbps, ratio}."""
    rows: list[dict[str, Any]] = []
    for bench in result.get("benchmarks", []):
        paths = bench.get("paths", {})
        baseline = bench.get("baseline")
        if baseline not in paths:
            continue
        for path, numbers in paths.items():
            if path == baseline:
                continue
            for direction in ("gather", "scatter"):
                rows.append(
                    {
                        "what": bench["name"],
                        "path": path,
                        "direction": direction,
                        "gbps": numbers[f"{direction}_gbps"],
                        "baseline": baseline,
                        "baseline_gbps": paths[baseline][f"{direction}_gbps"],
                        "ratio": numbers[f"{direction}_vs_baseline"],
                    }
                )
    engine = result.get("engine", {})
    if "store_gbps" in engine:
        what = f"CacheEngine, {engine['tokens']}-token prompt ({engine['connector']} + cpu tier)"
        for direction, key, base in (("store", "store", "d2h"), ("retrieve", "retrieve", "h2d")):
            rows.append(
                {
                    "what": what,
                    "path": "engine",
                    "direction": direction,
                    "gbps": engine[f"{key}_gbps"],
                    "baseline": engine["baseline"],
                    "baseline_gbps": engine[f"baseline_{base}_gbps"],
                    "ratio": engine[f"{key}_vs_baseline"],
                }
            )
    return rows


def _default_name(result: dict[str, Any]) -> str:
    device = re.sub(r"[^A-Za-z0-9]+", "-", str(result["environment"]["device"])).strip("-").lower()
    stamp = result["started_utc"][:16].replace(":", "").replace("-", "")
    return f"gpu_check-{'smoke-' if result['smoke_cpu'] else ''}{device}-{stamp}.json"


if __name__ == "__main__":
    sys.exit(main())
