"""Serving from a shared store: separate vLLM processes sharing one valkey tier.

A real ``valkey-server`` on 127.0.0.1 (kvplug_valkey.testing). Engine A is a prefill
node (``kv_producer``) that stores prompt X; engine B (``kv_both``, another process)
gets X as a full hit from valkey and stores prompt Y; engine C, a decode node
(``kv_consumer``), gets both X and Y as full hits. Every output equals vLLM's own
prefix-cache run of the same prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import kv_config, tokens

from kvplug_valkey.testing import ValkeyServer

# several real engines per test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(1200)

X = tokens(31, 576)  # 9 whole chunks of 64
Y = tokens(32, 448)  # 7


@pytest.fixture(scope="module")
def valkey(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ValkeyServer]:
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server


def run(run_engine: Any, valkey: ValkeyServer, role: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    kv = kv_config(
        role=role,
        **{"kvplug.tiers": [valkey.tier_options()], "kvplug.lookup_budget_s": 5.0, "kvplug.lookup_channel": "direct"},
    )
    result = run_engine(kv=kv, steps=[{"prompts": [{"tokens": p}], "max_tokens": 8} for p in prompts])
    return [step["outputs"][0] for step in result["steps"]]


@pytest.fixture(scope="module")
def reference(run_engine: Any) -> dict[str, list[int]]:
    """vLLM's own prefix cache: each prompt twice, the second a prefix-cache hit."""
    steps = [{"prompts": [{"tokens": p}], "max_tokens": 8} for p in (X, X, Y, Y)]
    outs = [step["outputs"][0]["tokens"] for step in run_engine(kv=None, steps=steps, prefix_caching=True)["steps"]]
    return {"X": outs[1], "Y": outs[3]}


def test_second_server_hits_what_the_first_stored(
    run_engine: Any, valkey: ValkeyServer, reference: dict[str, list[int]], tmp_path: Path
) -> None:
    (a_x,) = run(run_engine, valkey, "kv_producer", [X])
    assert a_x["kv"]["kvplug"]["totals"]["stored_tokens"] == len(X)
    b_x, b_y = run(run_engine, valkey, "kv_both", [X, Y])
    assert b_x["kv"]["kvplug"]["hit_tokens"] >= 0.9 * len(X)
    assert b_x["tokens"] == reference["X"]
    assert b_y["kv"]["kvplug"]["hit_tokens"] == 0
    c_x, c_y = run(run_engine, valkey, "kv_consumer", [X, Y])
    for out, prompt, name in ((c_x, X, "X"), (c_y, Y, "Y")):
        assert out["kv"]["kvplug"]["hit_tokens"] == len(prompt)  # 100% of the prompt
        assert out["tokens"] == reference[name]
    assert c_y["kv"]["kvplug"]["totals"]["stored_tokens"] == 0  # a consumer never stores
    assert c_y["kv"]["kvplug"]["totals"]["load_error_blocks"] == 0
