"""KV connectors that write per-request timestamps for ``bench_serving.py``'s breakdown.

``TimedKVPlugConnector`` and ``TimedLMCacheMPConnector`` are the real connectors
(subclasses, every method inherited) with a few of vLLM's connector calls wrapped to
append one JSON line per event to the file named by ``BENCH_SERVING_EVENTS``
(``os.write`` on an ``O_APPEND`` descriptor: one line per call, whole, from any thread).
Without that variable nothing is written. The server loads them through
``kv_connector_module_path`` (this folder on ``PYTHONPATH``); timestamps are
``time.time()``, the clock of the client's ``sent`` stamps and of vLLM's ``arrival_time``.

Events (``e``), all with ``t`` and, but for ``load_call``, the request id ``r``:

* ``ask``: the first time vLLM's scheduler asks the connector about a waiting request
  (``arrival``: vLLM's arrival time; ``local``: tokens vLLM's own prefix cache holds);
* ``answer``: the ask that got an answer (``n``: tokens to load, ``async``: loaded in
  the background; the connector's lookup ran between ``ask`` and this one);
* ``admitted``: vLLM allocated its blocks (``ext``: external tokens granted);
* ``scheduled``: the step that first schedules its computation (``computed``: tokens
  already in its blocks, vLLM's and the connector's; ``tokens``: scheduled this step);
* ``load_call``: the worker's ``start_load_kv`` of a step (``dt``: its seconds; a load
  not in the background runs inside it, before the step's forward pass);
* ``loaded``: the worker reported a background load done (``get_finished``), and
  ``load_seen``: the scheduler learned it (the request can be scheduled from that step).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

_FD: list[int] = []


def _emit(event: str, **fields: Any) -> None:
    path = os.environ.get("BENCH_SERVING_EVENTS")
    if not path:
        return
    if not _FD:
        _FD.append(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600))
    os.write(_FD[0], (json.dumps({"e": event, "t": time.time(), **fields}) + "\n").encode())


def _timed(base: type) -> type:
    """``base`` with its scheduler and worker calls stamped (see the module's docstring)."""

    class Timed(base):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._bench_asked: set[str] = set()
            self._bench_answered: set[str] = set()
            self._bench_scheduled: set[str] = set()

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            rid = request.request_id
            if rid not in self._bench_asked:
                self._bench_asked.add(rid)
                _emit("ask", r=rid, arrival=request.arrival_time, local=num_computed_tokens,
                      prompt=len(request.prompt_token_ids or ()))  # fmt: skip
            result = super().get_num_new_matched_tokens(request, num_computed_tokens)
            if result[0] is not None and rid not in self._bench_answered:
                self._bench_answered.add(rid)
                _emit("answer", r=rid, n=result[0], local=num_computed_tokens, **{"async": bool(result[1])})
            return result

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
            _emit("admitted", r=request.request_id, ext=num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            for new in scheduler_output.scheduled_new_reqs:
                if new.req_id not in self._bench_scheduled:
                    self._bench_scheduled.add(new.req_id)
                    tokens = scheduler_output.num_scheduled_tokens.get(new.req_id, 0)
                    _emit("scheduled", r=new.req_id, computed=new.num_computed_tokens, tokens=tokens)
            return super().build_connector_meta(scheduler_output)

        def update_connector_output(self, connector_output: Any) -> None:
            for rid in connector_output.finished_recving or ():
                _emit("load_seen", r=rid)
            super().update_connector_output(connector_output)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            started = time.time()
            super().start_load_kv(forward_context, **kwargs)
            _emit("load_call", dt=time.time() - started)

        def get_finished(self, finished_req_ids: set[str]) -> Any:
            result = super().get_finished(finished_req_ids)
            for rid in (result[1] if result else None) or ():
                _emit("loaded", r=rid)
            return result

    Timed.__name__ = Timed.__qualname__ = "Timed" + base.__name__
    return Timed


_BUILT: dict[str, type] = {}


def __getattr__(name: str) -> type:
    # Built on first use: the LMCache one imports LMCache, which only its own venv has.
    if name not in _BUILT:
        if name == "TimedKVPlugConnector":
            from kvplug_vllm.connector import KVPlugConnector

            _BUILT[name] = _timed(KVPlugConnector)
        elif name == "TimedLMCacheMPConnector":
            from lmcache.integration.vllm.lmcache_mp_connector import LMCacheMPConnector

            _BUILT[name] = _timed(LMCacheMPConnector)
        else:
            raise AttributeError(name)
    return _BUILT[name]
