"""One checkpoint run two ways on a shared tier: real vLLM engines, one with its model config
overridden (``hf_overrides``: another ``rope_theta`` rotates every key otherwise). The KV one run
computed is not the other's, so neither may load the other's chunks as its own. (The random
model's greedy tokens do not show the other rotation: the hit count does.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import kv_config, output, report, step

# four real engines in one test: more than the suite's default 300 s on a loaded machine
pytestmark = pytest.mark.timeout(900)

OVERRIDES = {"rope_parameters": {"rope_type": "default", "rope_theta": 2.0}}


def test_a_run_with_config_overrides_misses_the_plain_runs_chunks(run_engine: Any, tmp_path: Path) -> None:
    kv = kv_config(**{"kvplug.tiers": [{"type": "disk", "path": str(tmp_path / "kv")}]})
    plain = run_engine(kv=kv, steps=[step("P1")])
    assert report(plain, 0)["totals"]["stored_tokens"] >= 256
    overridden = run_engine(kv=kv, steps=[step("P1")], hf_overrides=OVERRIDES)
    assert report(overridden, 0)["hit_tokens"] == 0, "the overridden run loaded the plain run's KV as its own"
    reference = run_engine(kv=None, steps=[step("P1")], hf_overrides=OVERRIDES)
    assert output(overridden, 0) == output(reference, 0)
    again = run_engine(kv=kv, steps=[step("P1")], hf_overrides=OVERRIDES)  # another process, overridden alike
    assert report(again, 0)["hit_tokens"] == 256, "runs of one override do not share their chunks"
    assert output(again, 0) == output(reference, 0)
