"""Miss overhead of KVPlugConnector, proven: paired, interleaved TTFT measurements.

Two OpenAI servers run side by side on 127.0.0.1 (``python -m
vllm.entrypoints.openai.api_server``, same model, same options, prefix caching
off): A without any connector, B with kvplug on a cpu tier. Each pair sends one
fresh random prompt (never seen before, so B's lookup misses and B stores its
chunks, as in production) to A and another fresh prompt of the same length to B,
alternating which goes first (ABBA...), one request at a time. The server not being
measured is stopped (SIGSTOP of its process group) and resumed for its turn, so an
idle server's threads take no CPU from the measured one. Both servers reserve the
same number of cores for vLLM's scheduler (``VLLM_CPU_NUM_OF_RESERVED_CPU``, default
0 here): vLLM reserves one more core when any KV connector is configured, and on a
2-core machine that made the server without a connector compute on one core and
kvplug's on two (2x apart, 34-40 s against 17-27 s at 2048 tokens). TTFT is the wall time of a ``max_tokens=1`` completion (the
prefill plus the first token). The result is the median of the per-pair
differences B - A with a distribution-free 95% confidence interval for that median
(order statistics of the sign test), also relative to A's median TTFT.

The interval covers the request-to-request noise of one pair of servers, not the
difference between two server processes. ``kv=None`` measures that control: two
servers without a connector. On the 2-core VM (THP "madvise") two identical servers
differed by +8.4% [+7.0, +10.2], -9.3% [-11.8, -7.9], +5.2% and +10.1% in four runs
(2048 tokens, 16-20 pairs): whether torch's big allocations got huge pages was left
to chance. Both servers now run with ``THP_MEM_ALLOC_ENABLE=1`` (torch asks for huge
pages), and three control runs gave +0.3% [-4.2, +6.3], +2.0% [-0.7, +6.6] and -2.0%
[-6.2, +1.9]. The connector's own time inside a cold TTFT (``bench_vllm.py``'s
connector share) is the precise figure either way.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 600


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Server:
    """A running OpenAI server: its URL and its process group, which can be paused and resumed."""

    url: str
    pgid: int

    def pause(self) -> None:
        os.killpg(self.pgid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.pgid, signal.SIGCONT)
        _wait_healthy(self.url, time.monotonic() + 60)


#: The server options of the miss-overhead pairs: every prompt is computed (or loaded from kvplug).
MISS_OPTIONS = ("--no-enable-prefix-caching", "--max-num-seqs", "4")


@contextmanager
def openai_server(
    model: str,
    workdir: Path,
    name: str,
    kv: dict[str, Any] | None,
    max_model_len: int,
    options: Sequence[str] = MISS_OPTIONS,
    env_extra: Mapping[str, str] | None = None,
    python: str | None = None,
) -> Iterator[Server]:
    """A vLLM OpenAI server on 127.0.0.1 (own process group, SIGKILLed on exit).

    ``options``: more server arguments (bench_serving.py's keep prefix caching on);
    ``env_extra``: more environment variables, set over the ones below; ``python``: the
    interpreter that runs the server (this one by default; bench_serving.py's LMCache venv).
    """
    port = _free_port()
    args = [
        python or sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--served-model-name", "bench",
        "--skip-tokenizer-init", "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(max_model_len),
        *options,
    ]  # fmt: skip
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv)]
    env = {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        # vLLM's CPU worker leaves one core to the scheduler process, and one more when a KV
        # connector is configured (for NIXL) unless that leaves none: on 2 cores the server
        # without a connector computed on 1 core and kvplug's on 2. Both get the same cores.
        "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0"),
        # torch's CPU allocator asks for transparent huge pages: left to chance (THP
        # "madvise" here), two identical servers were up to 10% apart in TTFT.
        "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1"),
        # vLLM's internal message queue: on loopback, not the host's outward-facing address.
        "VLLM_HOST_IP": os.environ.get("VLLM_HOST_IP", "127.0.0.1"),
        # The engine core waits for each step's result with a deadline (300 s by default): a server
        # stopped (SIGSTOP) in the middle of a step failed "RPC call to execute_model timed out".
        "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS": os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "86400"),
        **(env_extra or {}),
    }
    log_path = workdir / f"{name}.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env, cwd=workdir
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                text = log_path.read_text()
                causes = [line for line in text.splitlines() if "Error" in line][-10:]
                raise RuntimeError(
                    f"server {name} exited with {proc.returncode}:\n" + "\n".join(causes) + "\n" + text[-3000:]
                )
            if _healthy(url):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"server {name} not healthy after {START_TIMEOUT_S}s")
            time.sleep(1)
        yield Server(url, proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _wait_healthy(url: str, deadline: float) -> None:
    while not _healthy(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"server {url} not healthy after it was resumed")
        time.sleep(0.2)


def ttft(url: str, tokens: list[int]) -> float:
    """Seconds of one ``max_tokens=1`` completion: prefill plus the first token."""
    body = json.dumps({"model": "bench", "prompt": tokens, "max_tokens": 1, "temperature": 0.0}).encode()
    request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=600) as response:
        response.read()
    return time.perf_counter() - started


def median_ci(values: list[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """Median and a distribution-free confidence interval for it (sign-test order statistics)."""
    ordered = sorted(values)
    n = len(ordered)
    alpha = (1 - confidence) / 2
    # largest k with P(Binomial(n, 1/2) <= k - 1) <= alpha: the interval is [x_(k), x_(n-k+1)]
    cumulative, k = 0.0, 0
    for i in range(n + 1):
        cumulative += math.comb(n, i) / 2**n
        if cumulative > alpha:
            k = i
            break
    k = max(k, 1)
    return statistics.median(ordered), ordered[k - 1], ordered[n - k]


def measure(
    model: str, workdir: Path, *, size: int, pairs: int, vocab: int, kv: dict[str, Any], warmup: int = 3
) -> dict[str, Any]:
    """Run the A/B pairs; returns per-pair TTFTs and the median difference with its 95% CI.

    ``kv=None`` gives B no connector either: the A/A control of two identical servers.
    """
    rng = random.Random(4242)

    def fresh() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(size)]

    with ExitStack() as stack:
        plain = stack.enter_context(openai_server(model, workdir, "no-connector", None, size + 64))
        kvplug = stack.enter_context(openai_server(model, workdir, "kvplug" if kv else "control", kv, size + 64))
        kvplug.pause()
        for _ in range(warmup):
            ttft(plain.url, fresh())
        plain.pause()
        kvplug.resume()
        for _ in range(warmup):
            ttft(kvplug.url, fresh())
        kvplug.pause()
        a_times, b_times = [], []
        for pair in range(pairs):
            order = [(plain, a_times), (kvplug, b_times)]
            if pair % 2:
                order.reverse()
            for server, times in order:
                server.resume()  # only the measured server runs
                times.append(ttft(server.url, fresh()))
                server.pause()
    diffs = [b - a for a, b in zip(a_times, b_times)]
    median, low, high = median_ci(diffs)
    base = statistics.median(a_times)
    return {
        "size": size,
        "pairs": pairs,
        "no_connector_median_s": base,
        "kvplug_miss_median_s": statistics.median(b_times),
        "diff_median_s": median,
        "diff_ci95_s": [low, high],
        "diff_median_pct": 100 * median / base,
        "diff_ci95_pct": [100 * low / base, 100 * high / base],
        "no_connector_s": a_times,
        "kvplug_miss_s": b_times,
    }
