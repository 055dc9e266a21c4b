"""What reading another TP size's records costs, next to a reader of the writer's own TP size.

A model with 8 KV heads of 128 (bf16, vLLM flash layout, block 16, 8 layers, 256-token
chunks: 4 MiB per chunk at TP=1), one ``disk`` tier (or ``--tier cpu``). With the
default ``heads_per_record: auto`` a TP=1 writer stores one record per chunk, a TP=2
writer one per rank. Rows, each timed in the same round as its baseline (the reader of
the writer's own TP size), as the median over rounds of (baseline time / row time):

* ``same TP, lookup hit`` and ``retrieve``: the baseline itself, 1.00 by definition:
  its path has not changed (its own records answer first);
* ``same TP, lookup miss``: a prompt nobody stored, against the same lookup before
  cross-TP reads (``others`` emptied): the price of asking for the other splits;
* ``TP=2 rank slices TP=1's record``: a rank's retrieve of its 4 heads out of the
  8-head records, against a TP=2 rank reading TP=2 records;
* ``TP=1 joins TP=2's records``: a TP=1 retrieve of two 4-head records per chunk,
  against a TP=1 engine reading its own 8-head records.

    python benchmarks/bench_mixed_tp.py [--tokens 4096] [--rounds 15] [--tier disk|cpu] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from kvplug import CacheEngine, Fingerprint, HeadShard, KVLayout, PagedFormat, get_registry, load_config

VLLM_FLASH = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
FULL = KVLayout(VLLM_FLASH, num_layers=8, block_size=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def engine(folder: Path, tier: str, tp_rank: int, tp_size: int) -> CacheEngine:
    layout = replace(FULL, num_kv_heads=8 // tp_size)
    spec: dict[str, Any] = {"type": tier, "queue": {"mode": "sync"}}
    if tier == "disk":
        spec["path"] = str(folder)
    extra = {"kvplug": {"chunk_size": 256, "store": {"queue": {"mode": "sync"}}, "tiers": [spec]}}
    config = load_config(engine_extra=extra, env={}).config
    heads = HeadShard.for_rank(total_heads=8, tp_rank=tp_rank, tp_size=tp_size)
    return CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="bench"), heads=heads)


def caches(layout: KVLayout, tokens: int) -> list[torch.Tensor]:
    blocks = tokens // layout.block_size
    return [torch.randn(2, blocks, layout.block_size, layout.num_kv_heads, layout.head_dim).to(layout.dtype)
            for _ in range(layout.num_layers)]  # fmt: skip


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tier", choices=["disk", "cpu"], default="disk")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    get_registry()
    tokens = list(range(args.tokens))
    other = list(range(10**6, 10**6 + args.tokens))
    slots = torch.arange(args.tokens)
    with tempfile.TemporaryDirectory() as scratch:
        # One tier shared by every engine of a row: a disk folder, or (cpu) one engine's tiers in one process.
        tp1 = engine(Path(scratch) / "tp1", args.tier, 0, 1)
        tp2 = [engine(Path(scratch) / "tp2", args.tier, rank, 2) for rank in range(2)]
        source = caches(FULL, args.tokens)
        tp1.store(tokens, source, slots)
        for rank, rank_engine in enumerate(tp2):
            half = [t[:, :, :, 4 * rank : 4 * rank + 4].contiguous() for t in source]
            rank_engine.store(other, half, slots)
        # Readers of the other side's folder (disk) or tiers (cpu: the writer engines' chains).
        if args.tier == "disk":
            slicer = engine(Path(scratch) / "tp1", "disk", 0, 2)
            joiner = engine(Path(scratch) / "tp2", "disk", 0, 1)
        else:
            slicer, joiner = tp1, tp2[0]  # a cpu tier is private to its engine: only same-TP rows apply
        rows: dict[str, list[float]] = {k: [] for k in ("miss", "slice", "join")}
        no_others = engine(Path(scratch) / "tp1", args.tier, 0, 1)
        no_others.records.others = []
        misses = list(range(2 * 10**6, 2 * 10**6 + args.tokens))
        target1, target2 = caches(FULL, args.tokens), caches(replace(FULL, num_kv_heads=4), args.tokens)
        for _ in range(args.rounds):
            rows["miss"].append(timed(lambda: no_others.lookup(misses)) / timed(lambda: tp1.lookup(misses)))
            if args.tier == "disk":
                base = timed(lambda: tp2[0].retrieve(other, target2, slots))
                rows["slice"].append(base / timed(lambda: slicer.retrieve(tokens, target2, slots)))
                base = timed(lambda: tp1.retrieve(tokens, target1, slots))
                rows["join"].append(base / timed(lambda: joiner.retrieve(other, target1, slots)))
        figures = {name: statistics.median(values) for name, values in rows.items() if values}
        for opened in [tp1, *tp2, no_others] + ([slicer, joiner] if args.tier == "disk" else []):
            opened.close()
    table = [
        ("same TP, lookup miss (vs no cross-TP reads)", figures["miss"]),
        *([("TP=2 rank slices TP=1's record (vs TP=2 records)", figures["slice"]),
           ("TP=1 joins TP=2's records (vs TP=1 records)", figures["join"])] if "slice" in figures else []),
    ]  # fmt: skip
    out = sys.stderr if args.json else sys.stdout
    print(
        f"{args.tokens} tokens, 8 KV heads x 128, 8 layers, chunk 256, tier {args.tier}, {args.rounds} rounds", file=out
    )
    print(f"{'row':52} {'speed vs baseline':>18}", file=out)
    for name, value in table:
        print(f"{name:52} {value:18.2f}", file=out)
    if args.json:
        print(json.dumps({"tier": args.tier, "tokens": args.tokens, **{k: round(v, 3) for k, v in figures.items()}}))


if __name__ == "__main__":
    main()
