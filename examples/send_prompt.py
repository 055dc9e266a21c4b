"""One completion request to the server that serve_cpu.sh started, timed and counted.

    python send_prompt.py URL METRICS_URL LABEL

Sends the same prompt every time (1000 token ids: three 256-token chunks and a partial
one; the random model has no tokenizer, so the server runs with --skip-tokenizer-init
and prompts are token ids), streamed, so the time to the first token (TTFT) is measured
where a client sees it. kvplug's tokens for the request are the change of its counters
on the worker's Prometheus endpoint (kvplug.metrics_port) across the request:
kvplug_hit_tokens_total (found by the lookup) and kvplug_loaded_tokens_total (written
into vLLM's cache instead of computed). Prints one line: LABEL, TTFT, hit and loaded
tokens, and the generated token ids.
"""

from __future__ import annotations

import json
import random
import sys
import time
import urllib.request

PROMPT = [random.Random(0).randrange(3, 1000) for _ in range(1000)]


def kvplug_counters(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        lines = response.read().decode().splitlines()
    return {line.split()[0]: float(line.split()[1]) for line in lines if line.startswith("kvplug_")}


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
    url, metrics_url, label = sys.argv[1:4]
    before = kvplug_counters(metrics_url)
    ttft, tokens = stream_completion(url)
    after = kvplug_counters(metrics_url)

    def delta(name: str) -> int:
        return int(after.get(name, 0) - before.get(name, 0))

    hit, loaded = delta("kvplug_hit_tokens_total"), delta("kvplug_loaded_tokens_total")
    print(f"{label:<22} TTFT {ttft * 1000:7.1f} ms   kvplug hit {hit:4d} tokens, loaded {loaded:4d}   output {tokens}")


if __name__ == "__main__":
    main()
