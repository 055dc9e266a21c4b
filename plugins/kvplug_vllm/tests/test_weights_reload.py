"""vLLM's in-place weight reload (``collective_rpc("reload_weights")``) on a real engine: from
then on kvplug loads none of the chunks stored before it (they are the old weights' KV) and
stores nothing (under the old keys, it would poison every server still on the old weights).

The reload reads the tiny model's own files again, so the weights do not change and greedy
outputs cannot show a wrong hit; what kvplug loads and stores can.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from conftest import CHUNK_SIZE, PROMPTS, kv_config, output, report, step


@pytest.mark.parametrize("multiprocessing", [False, True], ids=["in-process", "engine-core-process"])
def test_after_a_weight_reload_nothing_is_loaded_or_stored(
    run_engine: Callable[..., dict[str, Any]], baseline: dict[str, list[int]], multiprocessing: bool
) -> None:
    steps = [
        {**step("P1"), "reload_weights": True},  # P1's chunks: the old weights' KV
        step("P1"),
        step("P3"),  # computed with the new weights
        step("P3"),
    ]
    result = run_engine(kv=kv_config(), steps=steps, multiprocessing=multiprocessing)
    log = result["log"]
    p1_chunks = len(PROMPTS["P1"]) // CHUNK_SIZE * CHUNK_SIZE
    assert report(result, 0)["totals"]["stored_tokens"] >= p1_chunks  # the engine did store before the reload
    # The scheduler's lookup still finds P1's old chunks; the worker refuses to load them and vLLM recomputes.
    assert report(result, 1)["totals"]["loaded_tokens"] == 0, report(result, 1)
    assert "load refused: vLLM reloaded the model's weights in place" in log
    assert [output(result, i) for i in (1, 2)] == [baseline["P1"], baseline["P3"]]
    # Nothing computed after the reload was stored: P3 is a miss the second time.
    assert report(result, 3)["hit_tokens"] == 0, report(result, 3)
    assert report(result, 3)["totals"]["stored_tokens"] == report(result, 0)["totals"]["stored_tokens"]
    assert report(result, 3)["totals"]["loaded_tokens"] == 0
    assert log.count("vLLM reloaded the model's weights in place: kvplug's chunks") == 1
