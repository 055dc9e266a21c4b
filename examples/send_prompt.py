"""One completion request to the server that serve_cpu.sh started, timed and counted.

    python send_prompt.py URL LABEL

Sends the same prompt every time (1000 token ids: three 256-token chunks and a partial
one; the random model has no tokenizer, so the server runs with --skip-tokenizer-init
and prompts are token ids), streamed, so the time to the first token (TTFT) is measured
where a client sees it. Prints one line: LABEL, TTFT, kvplug's hit and loaded tokens for
the request, and the generated token ids.

kvplug's tokens are the change across the request of kvplug-vllm's counters on vLLM's
own ``URL/metrics`` (the server port): ``kvplug_hit_tokens_total``, the tokens kvplug
held past what vLLM's own prefix cache had, counted once when vLLM admits the request,
and ``kvplug_loaded_tokens_total``, the tokens kvplug wrote into vLLM's KV cache instead
of vLLM computing them. They match with or without vLLM's prefix cache. The worker's own
endpoint (``kvplug.metrics_port``) is not used: its ``kvplug_lookup_hit_tokens_total``
counts every token each lookup found, and vLLM may look a request up several times.
vLLM's figures reach its API server a moment after the step that made them, so the
script waits until the request's lookup (``kvplug_lookups_total`` one up) is there.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request

PROMPT = [random.Random(0).randrange(3, 1000) for _ in range(1000)]


def kvplug_counters(url: str) -> dict[str, float]:
    """kvplug's series on vLLM's ``/metrics``, summed over their labels (engine, model)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        lines = response.read().decode().splitlines()
    totals: dict[str, float] = {}
    for line in lines:
        if line.startswith("kvplug_"):
            series, value = line.rsplit(" ", 1)
            name = series.split("{")[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def counters_after(url: str, before: dict[str, float], timeout_s: float = 30.0) -> dict[str, float]:
    """The counters once the request's lookup has reached vLLM's API server (or after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = kvplug_counters(url)
        looked_up = after.get("kvplug_lookups_total", 0) > before.get("kvplug_lookups_total", 0)
        if looked_up or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def stream_completion(url: str) -> tuple[float, list[int]]:
    """(seconds to the first generated token, the generated token ids)."""
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.0,  # greedy: the same prompt gives the same tokens, cached or not
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    ttft = None
    tokens: list[int] = []
    with urllib.request.urlopen(request, timeout=300) as response:
        for raw in response:  # server-sent events: "data: {...}" lines, then "data: [DONE]"
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                if choice.get("token_ids"):
                    ttft = time.perf_counter() - started if ttft is None else ttft
                    tokens.extend(choice["token_ids"])
    assert ttft is not None, "the server streamed no tokens"
    return ttft, tokens


def main() -> None:
    url, label = sys.argv[1:3]
    before = kvplug_counters(url)
    ttft, tokens = stream_completion(url)
    after = counters_after(url, before)

    def delta(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    hit, loaded = delta("kvplug_hit_tokens_total"), delta("kvplug_loaded_tokens_total")
    print(f"{label:<22} TTFT {ttft * 1000:7.1f} ms   kvplug hit {hit:4d} tokens, loaded {loaded:4d}   output {tokens}")


if __name__ == "__main__":
    main()
