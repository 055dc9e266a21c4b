"""vLLM's multiprocess engine: scheduler (EngineCore) and worker are different processes.

The scheduler-side connector has no cache engine of its own; its lookups go over
the worker's lookup socket, so a hit here proves the channel works end to end.
"""

from __future__ import annotations

import uuid
from typing import Any

from conftest import kv_config, output, report, step

from kvplug_vllm.lookup import socket_path


def test_scheduler_process_sees_chunks_stored_by_the_worker(run_engine: Any, baseline: dict[str, list[int]]) -> None:
    engine_id = f"kvplug-test-{uuid.uuid4().hex}"
    kv = {**kv_config(), "engine_id": engine_id}
    result = run_engine(kv=kv, steps=[step("P1"), step("P1"), step("P2")], multiprocessing=True)
    assert "over the worker's lookup socket" in result["log"]
    assert [report(result, i)["hit_tokens"] for i in range(3)] == [0, 256, 192]
    assert output(result, 1) == baseline["P1"]
    assert output(result, 2) == baseline["P2"]
    assert report(result, 2)["totals"]["loaded_tokens"] == 256 + 192
    # the worker's shutdown stopped its lookup server and removed the socket
    assert not socket_path(engine_id, 0, 0).exists()
