"""Engines sharing a disk folder pin within its ``folder_pin_max_bytes`` together (90% of
``max_bytes`` by default), seen from the engine: a pin past it is ``refused`` in the pin report
(what ``kvplug ctl pin`` prints), and the folder's pinned bytes are a metric."""

from __future__ import annotations

from pathlib import Path

import torch
from core_helpers import LAYOUTS, engine_maker, random_caches
from prometheus_client import generate_latest

from kvplug.core.plugins import PluginRegistry

LAYOUT = LAYOUTS["vllm_flash"]
FIRST = list(range(5000, 5040))  # five chunks of 8 tokens
SECOND = list(range(7000, 7032))  # four


def test_a_pin_past_the_folders_pins_is_refused_in_the_report_and_the_sum_is_a_metric(tmp_path: Path) -> None:
    """Engine A pins five chunks, engine B (its own owner of the folder) four: each within its
    pin_max_bytes (60%), but B's fourth would take both engines' pins past the folder's 90%.
    5fdb4ad pinned it (``assert (4, 0) == (3, 1)``) and had no folder metric."""
    registry = PluginRegistry(plugin_filter="cpu,disk")
    tiers = [{"type": "disk", "path": str(tmp_path / "kv"), "max_bytes": "16KiB", "pin_max_bytes": "60%"}]
    caches = random_caches(LAYOUT, 16)
    with engine_maker(registry, tiers) as make:
        first, second = make(LAYOUT, None), make(LAYOUT, None)
        first.store(FIRST, caches, torch.arange(len(FIRST)))
        first.flush()
        assert first.pin(FIRST).chunks == 5
        file = int(first.chain.tiers[0].stats().extra["pinned_bytes"]) // 5  # one chunk's record file
        assert file * 9 > 0.9 * 16 * 1024 >= file * 8  # (what the sizes below rely on)
        second.store(SECOND, caches, torch.arange(len(SECOND)))
        second.flush()
        report = second.pin(SECOND)
        assert (report.chunks, report.refused) == (3, 1)
        assert second.chain.tiers[0].stats().extra["pins_refused"] == 1
        text = generate_latest(first.metrics.registry).decode()
    shown = [line for line in text.splitlines() if line.startswith("kvplug_folder_pinned_bytes{")]
    assert shown == [f'kvplug_folder_pinned_bytes{{tier="0:disk"}} {float(8 * file)}'], shown
