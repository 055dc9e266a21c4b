"""Memory stays within the configured budgets when far more than the cpu tier's budget
is stored through cpu + disk tiers, measured in a process of its own.

The issue's case, 3 GiB through a 256 MiB cpu tier, is scaled down 4x for CI: 768 MiB
through a 64 MiB cpu tier, with 32 MiB store and disk writer queues."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

WORKER = str(Path(__file__).with_name("memory_worker.py"))


def test_storing_twelve_cpu_budgets_grows_the_process_by_at_most_its_budgets(tmp_path: Path) -> None:
    cpu_mib, queue_mib, stored_mib = 64, 32, 768
    result = subprocess.run(
        [sys.executable, WORKER, str(tmp_path), str(cpu_mib), str(queue_mib), str(stored_mib)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    measured = json.loads(result.stdout.splitlines()[-1])
    budgets_mib = cpu_mib + 2 * queue_mib  # cpu tier + store queue + the disk tier's write queue
    assert measured["stored_mib"] >= 12 * cpu_mib and measured["disk_dropped"] == 0 and measured["disk_items"] > 0
    assert measured["growth_mib"] <= 1.15 * budgets_mib, measured
