"""Running a real engine for the KV oracle: one prompt, its paged KV captured once it is prefilled."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from conftest import report

from kvplug.testing import KVSlots, load_slots

_runs = itertools.count()


def captured_run(
    run_engine: Any,
    folder: Path,
    *,
    kv: dict[str, Any] | None,
    prompts: list[list[int]],
    max_tokens: int = 2,
    params: list[dict[str, Any]] | None = None,
    **options: Any,
) -> tuple[dict[str, Any], list[list[KVSlots]]]:
    """Run ``prompts`` one step each on one engine (``params[i]``: prompt ``i``'s kv_transfer_params),
    capturing each request's KV (every rank, every KV cache group) after its prefill; returns the
    driver's result and the captures."""
    paths = [folder / f"kv-{next(_runs)}" for _ in prompts]
    params = params or [{} for _ in prompts]
    steps = [
        {"prompts": [{"tokens": p, **({"params": q} if q else {})}], "max_tokens": max_tokens, "capture": str(path)}
        for p, q, path in zip(prompts, params, paths)
    ]
    result = run_engine(kv=kv, steps=steps, capture=True, **options)
    captures = [[s for file in step["capture"] for s in load_slots(file)] for step in result["steps"]]
    return result, captures


def loaded_tokens(result: dict[str, Any], index: int) -> int:
    """The tokens kvplug loaded into step ``index``'s request (its hit), checked to have loaded without errors."""
    hit = report(result, index)
    assert hit["totals"]["load_error_blocks"] == 0, hit
    return int(hit["hit_tokens"])
