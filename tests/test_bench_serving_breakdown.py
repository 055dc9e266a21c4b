"""bench_serving.py's per-request breakdown: the client's figures against a real HTTP server, and the
phases made of a connector's events (benchmarks/serving_workloads.py, benchmarks/serving_breakdown.py)."""

from __future__ import annotations

import io
import json
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import serving_breakdown as sb
from serving_workloads import Sizes, longdoc, multiround, play

SIZES = Sizes(users=2, system=40, document=60, rounds=3, question=8, answer=4, concurrency=2, documents=2, questions=2)


class _Completions(BaseHTTPRequestHandler):
    """A streamed ``/v1/completions`` that answers 4 token ids and vLLM's usage and per-request metrics."""

    seen: ClassVar[list[tuple[str | None, list[int]]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.headers.get("X-Request-Id"), body["prompt"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        answer = [sum(body["prompt"]) % 97 + i for i in range(body["max_tokens"])]
        for token in answer:
            self.wfile.write(f"data: {json.dumps({'choices': [{'token_ids': [token]}]})}\n\n".encode())
        usage = {"usage": {"prompt_tokens_details": {"cached_tokens": 7}},
                 "metrics": {"queue_time_ms": 1.5, "time_to_first_token_ms": 2.5}}  # fmt: skip
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def server_url() -> Iterator[str]:
    _Completions.seen = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_play_sends_request_ids_and_measures_the_reusable_prefix(server_url: str) -> None:
    workload = multiround(SIZES, "t", 1000)
    results, _ = play(server_url, workload, 1, "B.rep0.")
    by_key = {r.key: r for r in results}
    assert {rid for rid, _ in _Completions.seen} == {f"B.rep0.{r.key}" for r in results}
    assert all(r.request_id == f"B.rep0.{r.key}" for r in results)
    first = by_key["u0r0"]
    assert first.reusable == 0  # nothing finished before it
    assert by_key["u1r0"].reusable == SIZES.system  # the shared system prompt, from u0r0
    # round 1 holds round 0's prompt and answer: all of it computed but the answer's last token
    assert by_key["u0r1"].reusable == first.prompt_len + SIZES.answer - 1
    assert first.server == {"cached_tokens": 7, "queue_ms": 1.5, "prefill_ms": 2.5}
    assert first.sent_wall > 0


def test_longdoc_revisits_are_later_requests_and_first_visits_are_not(server_url: str) -> None:
    results, _ = play(server_url, longdoc(SIZES, "t", 1000), 1)
    later = {r.key for r in results if sb.later({"reusable": r.reusable, "prompt_len": r.prompt_len})}
    assert later == {"d0q1", "d1q1"}
    assert all(rid is None for rid, _ in _Completions.seen)  # no id_prefix: no header


def _request(**server: Any) -> dict[str, Any]:
    return {"request_id": "B.rep0.u0r1", "sent_wall": 1000.0, "ttft": 0.5, "prompt_len": 676, "reusable": 659,
            "server": {"cached_tokens": 512, "queue_ms": 40.0, "prefill_ms": 400.0, **server}}  # fmt: skip


def _events(rid: str = "cmpl-B.rep0.u0r1-0-1a2b", background: bool = False) -> list[dict[str, Any]]:
    t = 1000.0
    events = [
        {"e": "ask", "t": t + 0.050, "r": rid, "arrival": t + 0.010, "local": 128, "prompt": 676},
        {"e": "answer", "t": t + 0.060, "r": rid, "n": 384, "local": 128, "async": background},
        {"e": "admitted", "t": t + 0.061, "r": rid, "ext": 384},
        {"e": "scheduled", "t": t + 0.080, "r": rid, "computed": 512, "tokens": 164},
        {"e": "load_call", "t": t + 0.090, "dt": 0.006},
        {"e": "load_call", "t": t + 0.020, "dt": 0.003},  # an earlier step's: not this request's
    ]
    if background:
        events.insert(3, {"e": "loaded", "t": t + 0.075, "r": rid})
    return events


@pytest.mark.parametrize("background", [False, True])
def test_phases_add_up_to_the_client_ttft(background: bool) -> None:
    request = _request()
    sb.match_events([request], _events(background=background))
    b = request["breakdown"]
    phases = ["to_engine", "intake", "after", "before_ask", "lookup", "loading", "to_step", "queue_other"]
    assert sum(b[p] for p in phases) + b["sync_load"] + b["compute"] == pytest.approx(500.0)
    assert b["to_engine"] == pytest.approx(10.0)
    assert b["intake"] == pytest.approx(30.0)  # arrival to queued = scheduled - vLLM's 40 ms queue
    assert b["before_ask"] == pytest.approx(10.0)
    assert b["lookup"] == pytest.approx(11.0)  # first ask to admission
    assert (b["external"], b["local"], b["recomputed"], b["computed"]) == (384, 128, 147, 164)
    if background:
        assert (b["loading"], b["to_step"], b["sync_load"]) == (pytest.approx(14.0), pytest.approx(5.0), 0.0)
    else:
        assert (b["loading"], b["sync_load"]) == (0.0, pytest.approx(6.0))  # the load call begun after it
        assert b["compute"] == pytest.approx(394.0)


def test_a_server_without_events_keeps_vllms_two_figures() -> None:
    request = _request()
    sb.match_events([request], _events(rid="cmpl-B.rep0.u9r9-0-1a2b"))  # another request's events
    b = request["breakdown"]
    assert (b["queue_other"], b["compute"], b["outside"], b["lookup"]) == (40.0, 400.0, 60.0, 0.0)


def test_gap_to_the_floor_is_per_phase() -> None:
    mine, floor = _request(), _request(cached_tokens=640, prefill_ms=300.0)
    floor["request_id"] = ""
    sb.match_events([mine], _events())
    sb.match_events([floor], [])
    figures = sb.breakdown_table({"A-np": [{"results": [floor]}], "B": [{"results": [mine]}]}, "A-np", io.StringIO())
    gap = figures["gap_to_floor"]["B"]
    assert gap["ttft"] == pytest.approx(0.0) and gap["prefill"] == pytest.approx(100.0)
    assert gap["recomputed"] == 128 and gap["computed"] == 128


def test_read_events_leaves_a_half_written_line_for_next_time(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    path.write_text('{"e": "ask", "t": 1}\n{"e": "answ')
    events, offset = sb.read_events(path, 0)
    assert events == [{"e": "ask", "t": 1}]
    with path.open("a") as f:
        f.write('er", "t": 2}\n')
    assert sb.read_events(path, offset)[0] == [{"e": "answer", "t": 2}]
