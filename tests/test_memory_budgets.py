"""Budgets that cannot fit in memory are refused when the config is validated,
and every queue of chunk data has a byte bound in the config."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvplug import load_config
from kvplug.cli.main import app
from kvplug.core.config.model import physical_memory
from kvplug.errors import ConfigError

PHYSICAL = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def validate(tmp_path: Path, text: str) -> tuple[int, str]:
    path = tmp_path / "kvplug.yaml"
    path.write_text(text)
    result = CliRunner().invoke(app, ["config", "validate", str(path)], env={"COLUMNS": "300"})
    return result.exit_code, " ".join(result.output.split())


def test_config_validate_refuses_a_cpu_budget_above_physical_memory_and_names_it(tmp_path: Path) -> None:
    too_big = 2 * PHYSICAL
    code, output = validate(tmp_path, f"tiers: [{{type: cpu, max_bytes: {too_big}}}]\n")
    assert code != 0, output
    available, what = physical_memory()
    assert "tiers[0].max_bytes" in output and what.split(" (")[0] in output
    assert f"{available / 1024**3:.2f} GiB" in output


def test_budgets_of_several_in_memory_tiers_and_the_store_queue_add_up(tmp_path: Path) -> None:
    half = PHYSICAL // 2 + 1
    code, output = validate(tmp_path, f"tiers: [{{type: cpu, max_bytes: {half}}}, {{type: cpu, max_bytes: {half}}}]\n")
    assert code != 0 and "tiers[1].max_bytes" in output, output
    # (a folder of the test's own: validate opens the tier, and a file at a shared path is no folder)
    code, output = validate(
        tmp_path,
        f"tiers: [{{type: cpu, max_bytes: 1GiB}}, {{type: disk, path: {tmp_path / 'disk'}, max_bytes: 100TiB}}]\n",
    )
    assert code == 0 and "ok" in output, output  # a disk budget is not memory


def test_queue_byte_bounds_are_settings_with_a_positive_value(tmp_path: Path) -> None:
    config = load_config(
        engine_extra={
            "kvplug": {
                "store": {"queue": {"max_bytes": "64MiB"}},
                "tiers": [
                    {"type": "cpu", "max_bytes": "1GiB"},
                    {"type": "disk", "path": str(tmp_path), "queue": {"max_bytes": "32MiB"}},
                ],
            }
        },
        env={},
    ).config
    assert int(config.store.queue.max_bytes) == 64 * 1024**2
    assert int(config.tiers[1].options.queue.max_bytes) == 32 * 1024**2
    assert int(config.tiers[0].options.queue.max_bytes) == 256 * 1024**2
    with pytest.raises(ConfigError, match=r"store\.queue\.max_bytes"):
        load_config(engine_extra={"kvplug": {"store": {"queue": {"max_bytes": 0}}}}, env={})
