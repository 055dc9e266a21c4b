"""``benchmarks/gpu_check.py --smoke-cpu``: the GPU check's every step on CPU (Triton's interpreter), and its table.

A device machine is lent rarely and briefly: this shows the check runs end to end and
writes the file ``gpu_table.py`` reads, before one is spent on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHMARKS = Path(__file__).resolve().parents[3] / "benchmarks"
FIGURE_KEYS = {"what", "path", "direction", "gbps", "baseline", "baseline_gbps", "ratio"}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("gpu_check") / "smoke.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_check.py"), "--smoke-cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(out.read_text()), out


@pytest.mark.timeout(900)
def test_the_smoke_run_writes_every_step_with_its_baseline(smoke: tuple[dict[str, Any], Path]) -> None:
    result, _ = smoke
    assert result["schema"] == 1 and result["smoke_cpu"] is True
    assert {"device", "driver", "torch", "triton", "cuda", "python", "git_commit"} <= set(result["environment"])
    assert result["tests"]["returncode"] == 0 and result["tests"]["passed"] > 0
    names = [bench["name"] for bench in result["benchmarks"]]
    assert len(names) == 4 and any("64 blocks of 16 tokens" in name for name in names)
    for bench in result["benchmarks"]:
        assert "error" not in bench, bench
        assert bench["baseline"] in bench["paths"]
        assert {"cuda layerwise", "cuda pinned frame", "cuda one launch"} <= set(bench["paths"])
    engine = result["engine"]
    assert "error" not in engine, engine
    assert engine["connector"] == "cuda" and engine["bit_exact"] is True
    figures = result["figures"]
    # every connector path in both directions per case, and the engine's store and retrieve
    assert len(figures) == sum(2 * (len(b["paths"]) - 1) for b in result["benchmarks"]) + 2
    for figure in figures:
        assert set(figure) == FIGURE_KEYS
        # numbers only: the interpreter's figures round to 0 on a busy machine
        assert all(
            isinstance(figure[key], (int, float)) and figure[key] >= 0 for key in ("gbps", "baseline_gbps", "ratio")
        )


@pytest.mark.timeout(900)
def test_the_readme_table_comes_from_the_results_file(smoke: tuple[dict[str, Any], Path]) -> None:
    result, path = smoke
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_table.py"), str(path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "smoke run on CPU" in lines[0] and "torch " + result["environment"]["torch"] in lines[0]
    assert lines[2] == "| what | path | direction | GB/s | baseline | baseline GB/s | ratio |"
    rows = [line for line in lines[4:] if line.startswith("| ")]
    assert len(rows) == len(result["figures"])
    engine_rows = [row for row in rows if "| engine |" in row]
    assert [row.split(" | ")[2] for row in engine_rows] == ["store", "retrieve"]
