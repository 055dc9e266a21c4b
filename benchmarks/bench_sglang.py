"""Store/load throughput of kvplug's SGLang connector on a real CPU MHATokenToKVPool.

An 8-layer model's pool (bf16, 8 KV heads x 128) holds a prompt at scattered
slots; the connector stores it (gather + serialize + cpu tier, sync) and loads
it back into other slots, once per connector installed (the core's ``torch``, and
``native`` with kvplug-native). The baseline is a plain ``copy_`` of the same number
of bytes between two contiguous tensors, timed right before every sample: each ratio
is of a pair taken back to back. Prints a table with GB/s and the ratios (median and
interquartile range over the pairs); asserts nothing.

    python benchmarks/bench_sglang.py [--tokens 8192] [--repeat 5]

``--server`` adds a second section: time to first token of a real
``python -m sglang.launch_server`` (a random-weight Llama, prompts as token ids) with
``--radix-cache-backend kvplug`` over a cpu and a disk tier:

* ``sglang cold`` / ``sglang warm``: SGLang alone, a new prompt and then the same
  prompt again from SGLang's own radix cache (the baselines, same run);
* ``kvplug cold``: the kvplug server, a new prompt (lookup miss, prefill, store);
* ``kvplug after flush``: ``/flush_cache`` emptied SGLang's cache; kvplug's cpu tier
  serves the prefix;
* ``kvplug after restart``: a new server process; kvplug's disk tier serves it (the
  OS page cache is warm: this is kvplug's disk path, not the drive).

TTFT is the HTTP round trip of a one-token greedy ``/generate``, the median over
``--server-reps`` prompts. Outputs of the kvplug warm runs are checked against SGLang's
own warm run and mismatches counted. Without CUDA the server runs on the test-only CPU
platform (``plugins/kvplug_sglang/tests/sglang_cpu_platform``): SGLang's speed there is
not representative of SGLang on a GPU, only the ratios within one run mean something.
``--json`` prints one JSON object (both sections) as the last line.

    python benchmarks/bench_sglang.py --server [--server-tokens 4096] [--server-reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

warnings.filterwarnings("ignore")

import torch  # noqa: E402
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402

from kvplug_sglang.connector import KVPlugConnector, LoadMetadata, StoreMetadata  # noqa: E402

LAYERS, HEADS, HEAD_DIM = 8, 8, 128


class ModelFacts:
    """The ModelConfig fields the connector reads, for an 8-layer model."""

    model_path = "bench/8-layer"
    revision = None
    num_hidden_layers = LAYERS

    def get_num_kv_heads(self, tp_size: int) -> int:
        return HEADS // tp_size


def paired(repeat: int, fn, baseline, before=None) -> tuple[float, float, float, float]:
    """``fn`` timed ``repeat`` times, each right after one ``baseline`` call (``before`` runs untimed first).

    Returns fn's median seconds and the quartiles (q1, median, q3) of baseline time / fn
    time over the pairs: each ratio is of two timings taken back to back, so drift of the
    machine's speed between them cancels.
    """
    times, ratios = [], []
    for _ in range(repeat):
        if before is not None:
            before()
        started = time.perf_counter()
        baseline()
        middle = time.perf_counter()
        fn()
        ended = time.perf_counter()
        times.append(ended - middle)
        ratios.append((middle - started) / (ended - middle))
    q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return statistics.median(times), q1, median, q3


def allocator_slots(pool: MHATokenToKVPool, tokens: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots for the prompt and for its reload as SGLang's own allocator hands them out after churn.

    Requests of 64..1024 tokens fill the pool, two of every three are freed in random
    order, and the prompt and its reload destination are then allocated: runs as long
    as the freed requests were, in the order they were freed.
    """
    allocator = TokenToKVPoolAllocator(pool.size, pool.dtype, "cpu", pool, need_sort=False)
    held = []
    while (slots := allocator.alloc(rng.randrange(64, 1025))) is not None:
        held.append(slots)
    freed = [slots for i, slots in enumerate(held) if i % 3]
    rng.shuffle(freed)
    for slots in freed:
        allocator.free(slots)
    src, dst = allocator.alloc(tokens), allocator.alloc(tokens)
    if src is None or dst is None:
        raise SystemExit(f"the pool of {pool.size} slots cannot hold the prompt twice after churn")
    return src, dst


def connector_section(args: argparse.Namespace) -> dict[str, Any]:
    tokens = args.tokens
    pool = MHATokenToKVPool(
        size=4 * tokens + 16,
        page_size=1,
        dtype=torch.bfloat16,
        head_num=HEADS,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    for layer in range(LAYERS):
        pool.k_buffer[layer].normal_()
        pool.v_buffer[layer].normal_()
    perm = torch.randperm(pool.size)[: 2 * tokens] + 1
    slot_sets = {
        "allocator": allocator_slots(pool, tokens, random.Random(0)),
        "scattered": (perm[:tokens], perm[tokens:]),  # the worst case: no two slots adjacent in order
    }
    token_ids = list(range(tokens))
    nbytes = 2 * LAYERS * tokens * HEADS * HEAD_DIM * 2
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16).normal_()
    b = torch.empty_like(a)
    baseline = lambda: b.copy_(a)  # noqa: E731
    runs = {name: int((src[1:] - src[:-1] != 1).sum()) + 1 for name, (src, _) in slot_sets.items()}
    rows = []
    for kind in connector_types():
        connector = KVPlugConnector(
            ModelFacts(),
            1,
            0,
            pool.k_buffer,
            pool.v_buffer,
            engine_extra={
                "kvplug": {
                    "chunk_size": args.chunk_size,
                    "store": {"queue": {"mode": "sync"}},
                    "connector": {"type": kind},
                    "tiers": [{"type": "cpu", "max_bytes": 4 * nbytes}],
                }
            },
        )
        for name, (src_slots, dst_slots) in slot_sets.items():

            def store(src_slots: torch.Tensor = src_slots, connector: KVPlugConnector = connector) -> None:
                connector.store_kv(StoreMetadata(None, token_ids, src_slots, 0))

            def load(dst_slots: torch.Tensor = dst_slots, connector: KVPlugConnector = connector) -> None:
                assert connector.load_kv(LoadMetadata(token_ids, dst_slots, 0)) == tokens

            # reset first, untimed, so every round stores for real (kvplug skips chunks it has)
            rows.append((kind, f"store_kv {name}", *paired(args.repeat, store, baseline, before=connector.reset)))
            rows.append((kind, f"load_kv {name}", *paired(args.repeat, load, baseline)))
            for layer in range(LAYERS):  # the loaded KV is the stored KV
                assert torch.equal(pool.k_buffer[layer][dst_slots], pool.k_buffer[layer][src_slots])
                assert torch.equal(pool.v_buffer[layer][dst_slots], pool.v_buffer[layer][src_slots])
        connector.close()

    print(
        f"sglang connector, {LAYERS} layers x {HEADS} heads x {HEAD_DIM} bf16, {tokens} tokens, "
        f"chunk {args.chunk_size}: {nbytes / 2**20:.0f} MiB per pass, {args.repeat} pairs with copy_ each; "
        f"prompt slots in runs: allocator {runs['allocator']}, scattered {runs['scattered']}"
    )
    print(f"{'connector':<10} {'operation':<20} {'median ms':>10} {'GB/s':>7} {'of copy_ (median, IQR)':>26}")
    for kind, name, seconds, q1, median, q3 in rows:
        gbps = nbytes / seconds / 1e9
        print(f"{kind:<10} {name:<20} {seconds * 1e3:10.1f} {gbps:7.2f} {median:11.0%}  [{q1:.0%}, {q3:.0%}]")
    ratio = {(kind, name): median for kind, name, _, _, median, _ in rows}
    auto = default_connector()
    figures: dict[str, Any] = {
        "tokens": tokens,
        "chunk_size": args.chunk_size,
        "bytes": nbytes,
        "slot_runs": runs,
        "connector": auto,
        "ms": {f"{kind}.{name}": round(seconds * 1e3, 2) for kind, name, seconds, *_ in rows},
        "connectors": {
            kind: {f"{op}_vs_copy{suffix}": round(ratio[kind, f"{op}_kv {slots}"], 3)
                   for op in ("store", "load") for slots, suffix in (("allocator", ""), ("scattered", "_scattered"))}
            for kind in connector_types()
        },
    }  # fmt: skip
    # fractions of the same run's copy_ speed, for the connector `auto` picks (issue 16 goal 4: >= 0.8)
    figures.update(figures["connectors"][auto])
    return figures


def connector_types() -> list[str]:
    """The connectors installed here: the core's torch connector, and kvplug-native's when it is installed."""
    from kvplug import get_registry

    return [name for name in ("torch", "native") if name in get_registry().kv_connectors()]


def default_connector() -> str:
    """What ``connector: {type: auto}`` picks here."""
    from kvplug import get_registry

    usable = [cls for cls in get_registry().kv_connectors().values() if cls.is_available()]
    return max(usable, key=lambda cls: getattr(cls, "priority", 0)).name


def server_section(args: argparse.Namespace) -> dict[str, Any]:
    from kvplug_sglang.testing import ON_GPU, SGLangServer, kvplug_env, write_random_llama

    size, reps = args.server_tokens, args.server_reps
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 30000) for _ in range(size)] for _ in range(reps + 1)]
    warmup, prompts = prompts[0], prompts[1:]
    pool = max(8192, 2 * size * (reps + 1))
    times: dict[str, list[float]] = {}
    outputs: dict[str, list[list[int]]] = {}
    hits: list[int] = []

    def measure(server: SGLangServer, label: str, *, kvplug_hit: bool = False) -> None:
        for prompt in prompts:
            out, seconds, meta = server.ttft(prompt)
            times.setdefault(label, []).append(seconds)
            outputs.setdefault(label, []).append(out)
            if kvplug_hit:
                hits.append(int((meta.get("cached_tokens_details") or {}).get("host", 0)))

    with tempfile.TemporaryDirectory(prefix="bench-sglang-") as tmp:
        work = Path(tmp)
        model = str(write_random_llama(work / "model", large=True))

        def start(extra: list[str], env: dict[str, str], name: str) -> SGLangServer:
            server = SGLangServer(model, extra, env, work / f"{name}.log", max_total_tokens=pool).wait_healthy()
            server.ttft(warmup)
            return server

        base = start([], {}, "sglang")
        try:
            for prompt in prompts:
                for label in ("sglang cold", "sglang warm"):
                    out, seconds, _ = base.ttft(prompt)
                    times.setdefault(label, []).append(seconds)
                    outputs.setdefault(label, []).append(out)
        finally:
            base.stop()
        tiers = [{"type": "cpu", "max_bytes": "4GiB"}, {"type": "disk", "path": str(work / "kv")}]
        args_kv, env_kv = ["--radix-cache-backend", "kvplug"], kvplug_env(tiers, args.chunk_size)
        server = start(args_kv, env_kv, "kvplug")
        try:
            measure(server, "kvplug cold")
            time.sleep(1.0)  # the store worker writes the tiers in the background
            server.flush_cache()
            measure(server, "kvplug after flush", kvplug_hit=True)
        finally:
            server.stop()
        server = start(args_kv, env_kv, "kvplug-restarted")
        try:
            measure(server, "kvplug after restart", kvplug_hit=True)
        finally:
            server.stop()

    base_cold = statistics.median(times["sglang cold"])
    mismatches = sum(
        a != b
        for label in ("kvplug after flush", "kvplug after restart")
        for a, b in zip(outputs[label], outputs["sglang warm"])
    )
    print(
        f"\nsglang server ({'GPU' if ON_GPU else 'CPU test platform: not representative of SGLang speed'}), "
        f"random Llama (512 hidden, 4 layers), {size}-token prompts, median of {reps}, chunk {args.chunk_size}"
    )
    print(f"{'TTFT':<22} {'median ms':>10} {'x sglang cold':>14}")
    for label, values in times.items():
        med = statistics.median(values)
        print(f"{label:<22} {med * 1e3:10.1f} {med / base_cold:14.2f}")
    print(
        f"kvplug hit tokens per warm request: {min(hits)}..{max(hits)} of {size}; "
        f"outputs differing from SGLang's own warm run: {mismatches} of {2 * reps}"
    )
    return {
        "device": "gpu" if ON_GPU else "cpu-test-platform",
        "tokens": size,
        "reps": reps,
        "ttft_ms": {label: round(statistics.median(values) * 1e3, 2) for label, values in times.items()},
        "kvplug_hit_tokens_min": min(hits),
        "output_mismatches": mismatches,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--chunk-size", type=int, default=256)
    parser.add_argument("--server", action="store_true", help="also time a real sglang.launch_server (minutes)")
    parser.add_argument("--server-only", action="store_true", help="only the server section")
    parser.add_argument("--server-tokens", type=int, default=4096)
    parser.add_argument("--server-reps", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    args = parser.parse_args()
    result: dict[str, Any] = {"benchmark": "bench_sglang"}
    if not args.server_only:
        result["connector"] = connector_section(args)
    if args.server or args.server_only:
        result["server"] = server_section(args)
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
