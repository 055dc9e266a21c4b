"""Per-request breakdown of ``bench_serving.py``: where a request's time to first token went.

Sources, per request: the client (sent, TTFT, the prompt's ``reusable`` prefix: what an
earlier, finished request had computed), vLLM's own per-request figures in the final
usage chunk (``--enable-per-request-metrics``: queue = queued to first scheduled for
computation, which includes a connector's lookup and background load; prefill = scheduled
to first token; ``cached_tokens``: the prompt tokens it did not compute, its own cache's and
the connector's), and for servers with a connector the events of ``timed_connector``
(wall-clock stamps of the scheduler's first ask, the lookup's answer, admission, the load,
the step that schedules it).

Phases, in milliseconds, adding up to the client's TTFT:

* ``outside``: TTFT - queue - prefill: outside vLLM's two figures. With connector events it
  splits into ``to_engine`` (sent to vLLM's arrival stamp: HTTP, the front end), ``intake``
  (arrival to the engine core queueing it, ``scheduled - queue``: the engine core reads new
  requests between steps, so this is the rest of the step running then) and ``after``
  (the engine's first token to the client);
* ``queue``: vLLM's queue time (queued to first scheduled for computation), split with
  events into ``before_ask`` (queued to the scheduler's first ask: requests ahead of it),
  ``lookup`` (first ask to admission: a lookup answered in a later step waits for it),
  ``loading`` (admitted to the worker reporting a background load done), ``to_step``
  (load done to the step that schedules it) and ``queue_other`` (the rest);
* ``prefill``: scheduled to first token (vLLM's): the whole step's forward pass, other
  requests' prefill chunks batched with it included, of which ``sync_load`` (a load in
  the step itself, before its forward pass: ``start_load_kv``) and ``compute``.

Tokens: ``prompt``, ``reusable``, ``cached`` (vLLM's ``cached_tokens``), ``computed``
(prompt - cached), ``recomputed`` (reusable - cached: computed again though an earlier
request had computed them: a cache's granularity, or its misses), and with a connector
``local`` (vLLM's own cache held them when the connector was asked) and ``external`` (the
connector's answer: tokens to load).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PHASES = ["outside", "to_engine", "intake", "after", "queue", "before_ask", "lookup", "loading", "to_step",
          "queue_other", "prefill", "sync_load", "compute"]  # fmt: skip
TOKENS = ["prompt", "reusable", "cached", "computed", "recomputed", "local", "external"]


def read_events(path: Path | None, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The events appended to ``path`` since ``offset``, and the new offset."""
    if path is None or not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1  # a line being written is read next time
    return [json.loads(line) for line in data[:end].splitlines() if line.strip()], offset + end


def match_events(results: list[dict[str, Any]], events: list[dict[str, Any]]) -> None:
    """Add ``breakdown`` to each result (dicts of ``Result``) from its events and vLLM's figures."""
    by_request: dict[str, dict[str, dict[str, Any]]] = {}
    for e in events:
        if "r" in e:
            by_request.setdefault(e["r"], {}).setdefault(e["e"], e)  # the first of each kind
    load_calls = sorted((e["t"] - e["dt"], e["dt"]) for e in events if e["e"] == "load_call")
    for r in results:
        prefix = f"cmpl-{r['request_id']}-"
        mine = next((v for k, v in by_request.items() if k.startswith(prefix)), {}) if r["request_id"] else {}
        r["breakdown"] = breakdown(r, mine, load_calls)


def breakdown(
    r: dict[str, Any], ev: dict[str, dict[str, Any]], load_calls: list[tuple[float, float]]
) -> dict[str, Any]:
    server = r["server"]
    ttft = r["ttft"] * 1e3
    cached = server.get("cached_tokens") or 0
    b: dict[str, Any] = {"ttft": ttft, "prompt": r["prompt_len"], "reusable": r["reusable"], "cached": cached,
                         "computed": r["prompt_len"] - cached, "recomputed": max(0, r["reusable"] - cached)}  # fmt: skip
    queue, prefill = server.get("queue_ms"), server.get("prefill_ms")
    if queue is None or prefill is None:
        return b
    b["queue"], b["prefill"], b["outside"] = queue, prefill, ttft - queue - prefill
    zero = (
        "to_engine",
        "intake",
        "after",
        "before_ask",
        "lookup",
        "loading",
        "to_step",
        "sync_load",
        "local",
        "external",
    )
    b.update(dict.fromkeys(zero, 0.0), queue_other=queue, compute=prefill)
    ask, scheduled = ev.get("ask"), ev.get("scheduled")
    if ask is None or scheduled is None:  # no connector: vLLM's figures alone
        return b
    ms = 1e3
    arrival = ask["arrival"]
    queued = scheduled["t"] - queue / ms  # vLLM's scheduled stamp and this one: the same schedule() call
    answer, admitted = ev.get("answer"), ev.get("admitted")
    b["to_engine"] = (arrival - r["sent_wall"]) * ms
    b["intake"] = (queued - arrival) * ms
    b["after"] = b["outside"] - b["to_engine"] - b["intake"]
    b["before_ask"] = (ask["t"] - queued) * ms
    b["lookup"] = ((admitted or answer or ask)["t"] - ask["t"]) * ms
    b["local"] = ask.get("local") or 0
    b["external"] = (answer or {}).get("n") or 0
    b["background"] = bool((answer or {}).get("async"))
    loaded = ev.get("loaded") or ev.get("load_seen")
    b["loading"] = (loaded["t"] - admitted["t"]) * ms if loaded and admitted else 0.0
    start = loaded or admitted or answer or ask
    b["to_step"] = max(0.0, (scheduled["t"] - start["t"]) * ms)
    b["queue_other"] = queue - (b["before_ask"] + b["lookup"] + b["loading"] + b["to_step"])
    if b["external"] and not b["background"]:
        # the worker's start_load_kv of the step that scheduled it (the first one begun after)
        b["sync_load"] = next((dt * ms for t0, dt in load_calls if t0 >= scheduled["t"] - 1e-4), 0.0)
    b["compute"] = prefill - b["sync_load"]
    return b


def later(r: dict[str, Any]) -> bool:
    """A request a cache can serve: at least half its prompt computed before by a finished request."""
    return 2 * r["reusable"] >= r["prompt_len"]


def mean_breakdown(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Means over every repetition's later requests (means add up: the phases sum to the mean TTFT)."""
    rows = [r["breakdown"] for run in runs for r in run["results"] if later(r) and "queue" in r["breakdown"]]
    if not rows:
        return {}
    keys = ["ttft", *PHASES, *TOKENS]
    out = {k: statistics.fmean(row.get(k, 0.0) for row in rows) for k in keys}
    out["requests"] = len(rows)
    out["ttft_p50"] = statistics.median(row["ttft"] for row in rows)
    return out


def breakdown_table(runs: dict[str, list[dict[str, Any]]], floor: str | None, out: Any) -> dict[str, Any]:
    """Print the later requests' mean breakdown per configuration, and each one's gap to ``floor``'s."""
    means = {config: mean_breakdown(reps) for config, reps in runs.items()}
    print("\nlater requests, mean per request over every repetition (ms; tokens); phases add up to TTFT:", file=out)
    cols = ["ttft", *PHASES, *TOKENS]
    print(f"{'config':<8}{'n':>4}" + "".join(f"{c[:10]:>11}" for c in cols), file=out)
    for config, m in means.items():
        if m:
            print(f"{config:<8}{m['requests']:>4.0f}" + "".join(f"{m[c]:>11.1f}" for c in cols), file=out)
    print("(outside = to_engine + intake + after, split only with a connector's events; queue = before_ask + lookup"
          " + loading + to_step + queue_other; prefill = sync_load + compute)", file=out)  # fmt: skip
    gaps: dict[str, Any] = {}
    if floor and means.get(floor):
        print(f"\ngap to {floor} (ms, mean per later request; tokens):", file=out)
        for config, m in means.items():
            if config == floor or not m:
                continue
            gaps[config] = {c: m[c] - means[floor][c] for c in cols}
            print(f"{config:<12}" + "".join(f"{c} {gaps[config][c]:+.1f}  " for c in cols), file=out)
    return {"mean_later": means, "gap_to_floor": gaps}
