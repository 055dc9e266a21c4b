"""Gather/scatter bandwidth of the ``cuda`` connector vs the ``torch`` connector vs plain ``copy_``.

One run measures, for chunks of ``--tokens`` tokens of a ``--layers``-layer model:

* ``copy_ pinned``: a plain host<->device ``copy_`` of the chunk's bytes between a
  pinned host tensor and a contiguous device tensor (the bus's practical ceiling);
* ``copy_ pageable``: the same into ordinary host memory (what a serializer frame is);
* ``torch``: the core's reference connector, whole chunk (``gather``/``scatter``);
* ``cuda layerwise``: ``plan`` + ``gather_layer``/``scatter_layer`` for every layer +
  ``synchronize``, into/out of ordinary host memory (through the pinned staging pool);
* ``cuda pinned frame``: the same into/out of a frame of a pinned frame pool, the
  engine's path on a GPU (DMA straight to the frame);
* ``cuda one launch``: ``gather``/``scatter`` of all layers in one kernel launch.

Each figure is bytes / wall time until the data is usable by the host (gather) or
by the device's current stream (scatter), median of ``--iters`` runs; ratios are
against ``copy_ pinned`` of the same run. Without CUDA it says so and exits 0.
``--json`` sends the table to stderr and prints one JSON object (figures and ratios;
``skipped`` without CUDA) as the last line of stdout.

    python benchmarks/bench_cuda.py [--layout vllm_flash] [--dtype bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default="vllm_flash", choices=["vllm_flash", "vllm_mla", "sglang_mha"])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32", "float8_e4m3fn"])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--smoke-cpu",
        action="store_true",
        help="run the connector paths on CPU tensors in Triton's interpreter to check the script; numbers mean nothing",
    )
    parser.add_argument("--json", action="store_true", help="table on stderr; one JSON object as stdout's last line")
    args = parser.parse_args(argv)
    if not args.json:
        return _measure(args, {})
    stdout, sys.stdout = sys.stdout, sys.stderr  # the table; stdout keeps the JSON line
    figures: dict[str, object] = {"benchmark": "bench_cuda"}
    try:
        status = _measure(args, figures)
    finally:
        sys.stdout = stdout
    print(json.dumps(figures))
    return status


def _measure(args: argparse.Namespace, figures: dict[str, object]) -> int:
    if args.smoke_cpu:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("bench_cuda: no CUDA device here (torch.cuda.is_available() is False); nothing to measure.")
        figures["skipped"] = "no CUDA device"
        return 0
    else:
        device = torch.device("cuda")

    from kvplug import KVLayout, PagedFormat
    from kvplug.builtins.torch_connector import TorchConnector
    from kvplug.core.engine.frame_pool import GRANULARITY, FramePool
    from kvplug.testing import gather_chunk, scatter_chunk
    from kvplug_cuda import CudaConnector

    dtype = getattr(torch, args.dtype)
    heads = 1 if args.layout == "vllm_mla" else args.heads
    block_size = 1 if args.layout == "sglang_mha" else args.block_size
    # the formats as the vLLM/SGLang adapters declare them (same names: same fingerprints)
    formats = {
        "vllm_flash": PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim")),
        "vllm_mla": PagedFormat("vllm_mla", ("block", "token", "dim"), latent=True),
        "sglang_mha": PagedFormat("sglang_mha", ("slot", "head", "dim"), tensors=2),
    }
    layout = KVLayout(formats[args.layout], args.layers, block_size, heads, args.head_dim, dtype)
    caches, slots = _paged_caches(layout, args.tokens, device)
    chunk_bytes = layout.bytes_per_token() * args.tokens
    frame = torch.empty(layout.chunk_shape(args.tokens), dtype=dtype)  # pageable, like a serializer frame
    reference = TorchConnector(TorchConnector.Config(), layout)
    cuda = CudaConnector(CudaConnector.Config(pinned_pool_bytes=max(256 * 1024**2, 4 * chunk_bytes)), layout)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    # What the engine hands the connector on a GPU: a frame of its frame pool, page-locked
    # once with cudaHostRegister, so the DMA goes straight to it (pageable here without CUDA).
    frame_pool = FramePool(chunk_bytes + GRANULARITY, pin=device.type == "cuda")
    pool_frame = torch.frombuffer(frame_pool.new_buffer(chunk_bytes), dtype=torch.uint8)
    pool_frame = pool_frame.view(dtype).view(layout.chunk_shape(args.tokens))

    def layerwise_gather(into: torch.Tensor) -> None:
        plan = cuda.plan(slots)
        for layer, cache in enumerate(caches):
            cuda.gather_layer(cache, plan, into[layer])
        cuda.synchronize()

    def layerwise_scatter(source: torch.Tensor) -> None:
        plan = cuda.plan(slots)
        for layer, cache in enumerate(caches):
            cuda.scatter_layer(cache, plan, source[layer])
        cuda.synchronize()
        sync()

    rows: list[tuple[str, Callable[[], None], Callable[[], None]]] = []
    if device.type == "cuda":
        device_bytes = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
        pinned = torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True)
        pageable = torch.empty(chunk_bytes, dtype=torch.uint8)
        rows += [
            (
                "copy_ pinned",
                lambda: (pinned.copy_(device_bytes, non_blocking=True), sync()),
                lambda: (device_bytes.copy_(pinned, non_blocking=True), sync()),
            ),
            (
                "copy_ pageable",
                lambda: (pageable.copy_(device_bytes), sync()),
                lambda: (device_bytes.copy_(pageable), sync()),
            ),
        ]
    rows += [
        (
            "torch",
            lambda: (gather_chunk(reference, caches, slots, frame), sync()),
            lambda: (scatter_chunk(reference, caches, slots, frame), sync()),
        ),
        ("cuda layerwise", lambda: layerwise_gather(frame), lambda: layerwise_scatter(frame)),
        ("cuda pinned frame", lambda: layerwise_gather(pool_frame), lambda: layerwise_scatter(pool_frame)),
        (
            "cuda one launch",
            lambda: (cuda.gather(caches, slots, frame), cuda.synchronize()),
            lambda: (cuda.scatter(caches, slots, frame), cuda.synchronize(), sync()),
        ),
    ]
    iters = 1 if args.smoke_cpu else args.iters
    print(
        f"bench_cuda: {args.layout} {args.dtype}, {args.layers} layers x {args.tokens} tokens, {heads} heads x "
        f"{args.head_dim}, block {block_size}: {chunk_bytes / 2**20:.1f} MiB per chunk; device {_device_name(device)}"
    )
    print(f"ratios (x) are against the first row, {rows[0][0]!r}")
    print(f"{'path':<19}{'gather GB/s':>12}{'x':>7}{'scatter GB/s':>14}{'x':>7}")
    baseline: tuple[float, float] | None = None
    figures.update(layout=args.layout, dtype=args.dtype, chunk_bytes=chunk_bytes, device=_device_name(device))
    paths: dict[str, dict[str, float]] = {}
    for name, gather, scatter in rows:
        g = chunk_bytes / _median_seconds(gather, iters) / 1e9
        s = chunk_bytes / _median_seconds(scatter, iters) / 1e9
        baseline = baseline or (g, s)
        print(f"{name:<19}{g:>12.2f}{g / baseline[0]:>7.2f}{s:>14.2f}{s / baseline[1]:>7.2f}")
        paths[name] = {
            "gather_gbps": round(g, 3),
            "gather_vs_baseline": round(g / baseline[0], 4),
            "scatter_gbps": round(s, 3),
            "scatter_vs_baseline": round(s / baseline[1], 4),
        }
    figures["baseline"] = rows[0][0]
    figures["paths"] = paths
    if device.type == "cuda":
        check = torch.empty_like(frame)
        gather_chunk(reference, caches, slots, check)
        cuda.gather(caches, slots, frame)
        cuda.synchronize()
        layerwise_gather(pool_frame)
        same = all(torch.equal(check.view(torch.uint8), got.view(torch.uint8)) for got in (frame, pool_frame))
        frames_pinned = frame_pool.stats().pinned
        print(f"bit-exact vs torch: {same}; frame pool pinned: {frames_pinned}; staging: {cuda.stats().pool}")
        figures["bit_exact"] = same
        if not same:
            return 1
    return 0


def _paged_caches(layout, tokens: int, device: torch.device) -> tuple[list, torch.Tensor]:
    """Caches with 4x the chunk's blocks, and whole blocks of the chunk in shuffled order."""
    blocks_needed = -(-tokens // layout.block_size)
    num_blocks = 4 * blocks_needed
    b, h, d = layout.block_size, layout.num_kv_heads, layout.head_dim
    shape = {"vllm_flash": (2, num_blocks, b, h, d), "vllm_mla": (num_blocks, b, d)}.get(
        layout.format.name, (num_blocks * b, h, d)
    )
    itemsize = torch.empty((), dtype=layout.dtype).element_size()

    def random_tensor() -> torch.Tensor:
        raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, device=device)
        return raw.view(layout.dtype)

    caches = [
        (random_tensor(), random_tensor()) if layout.format.tensors == 2 else random_tensor()
        for _ in range(layout.num_layers)
    ]
    blocks = torch.randperm(num_blocks, device=device)[:blocks_needed]
    slots = (blocks[:, None] * b + torch.arange(b, device=device)).reshape(-1)[:tokens]
    return caches, slots


def _median_seconds(fn: Callable[[], object], iters: int) -> float:
    fn()  # warm up: kernel compilation, pinned pool allocation
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (Triton interpreter smoke run)"


if __name__ == "__main__":
    sys.exit(main())
