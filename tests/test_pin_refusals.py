"""Refusals are never silent: ``pin_max_bytes`` must leave room for unpinned chunks, a store
a tier cannot keep beside its pins or within its tenant's quota is counted and logged,
and ``kvplug ctl pin`` says how many pins the pin book refused. Real engines with real
cpu and disk tiers, the real config loader, the real control server and CLI."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, random_caches
from typer.testing import CliRunner

from kvplug import (
    RECORD_HEADER_SIZE,
    CacheEngine,
    ControlIdentity,
    ControlServer,
    Fingerprint,
    RequestInfo,
    load_config,
)
from kvplug.cli.main import app
from kvplug.errors import ConfigError

LAYOUT = LAYOUTS["vllm_flash"]
CACHES = random_caches(LAYOUT, 16)


def prompt(i: int, chunks: int = 1) -> list[int]:
    return [100_000 + 1000 * i + t for t in range(8 * chunks)]


def tier(kind: str, tmp_path: Path, **options: Any) -> dict[str, Any]:
    return {"type": kind, **({"path": str(tmp_path / "disk")} if kind == "disk" else {}), **options}


def make(tmp_path: Path, tiers: list[dict[str, Any]], **extra: Any) -> CacheEngine:
    settings = {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers, **extra}
    config = load_config(engine_extra={"kvplug": settings}, env={}).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="refusals"))


def store(engine: CacheEngine, tokens: list[int], salt: str | None = None) -> None:
    engine.store(tokens, CACHES, torch.arange(len(tokens)), request=RequestInfo(cache_salt=salt))
    engine.flush()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
@pytest.mark.parametrize("share", ["100%", "95%", "90.5%", "max_bytes", "max_bytes-1"])
def test_a_pin_budget_that_leaves_unpinned_chunks_no_room_is_refused(tmp_path: Path, kind: str, share: str) -> None:
    value: object = {"max_bytes": 1_000_000, "max_bytes-1": 999_999}.get(share, share)
    with pytest.raises(ConfigError) as caught:
        make(tmp_path, [tier(kind, tmp_path, max_bytes=1_000_000, pin_max_bytes=value)])
    text = str(caught.value)
    assert "pin_max_bytes" in text and "at most 90% of max_bytes" in text, text


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_pin_budget_of_90_percent_is_accepted(tmp_path: Path, kind: str) -> None:
    for value in ("90%", 900_000):
        make(tmp_path, [tier(kind, tmp_path, max_bytes=1_000_000, pin_max_bytes=value)]).close()


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_pin_budget_of_0_or_0_percent_is_accepted(tmp_path: Path, kind: str) -> None:
    """0% is 0 (no pins), as for every share: ee9bb23 took 0 and refused 0% (``ConfigError:
    pin_max_bytes: '0%' must be a percentage greater than 0 and at most 100``)."""
    for value in ("0%", 0):
        make(tmp_path, [tier(kind, tmp_path, max_bytes=1_000_000, pin_max_bytes=value)]).close()


def chunk_bytes(tmp_path: Path, kind: str) -> int:
    """What one chunk counts against a tier's budgets (the disk tier: its record file)."""
    with make(tmp_path / "probe", [tier(kind, tmp_path / "probe", max_bytes="1MiB")]) as engine:
        store(engine, prompt(0))
        engine.pin(prompt(0))
        return int(engine.chain.tiers[0].stats().extra["pinned_bytes"])


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_a_store_with_no_room_beside_the_pinned_chunks_is_counted_and_logged(
    tmp_path: Path, kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    size = chunk_bytes(tmp_path, kind)
    value = size - RECORD_HEADER_SIZE if kind == "disk" else size  # the disk tier's max_bytes counts values
    # Four chunks fill the pin budget; what is left (one byte short of a chunk) holds no chunk.
    options = {"max_bytes": 5 * value - 1, "pin_max_bytes": 4 * size}
    with make(tmp_path, [tier(kind, tmp_path, **options)]) as engine, caplog.at_level(logging.WARNING):
        system = prompt(1, chunks=4)
        engine.pin(system)
        store(engine, system)
        assert engine.chain.tiers[0].stats().extra["pinned_items"] == 4
        for i in range(3):
            store(engine, prompt(10 + i))
        assert engine.metrics.value("kvplug_stores_refused_total", tier=f"0:{kind}", reason="pins") == 3
        assert engine.lookup(system) == len(system)  # the pinned chunks, untouched
        lines = [r.getMessage() for r in caplog.records if "refused (pins)" in r.getMessage()]
        assert len(lines) == 1 and "left beside the pinned chunks" in lines[0]  # rate-limited: one line


def test_a_chunk_larger_than_its_tenant_s_quota_is_counted(tmp_path: Path) -> None:
    size = chunk_bytes(tmp_path, "cpu")
    with make(tmp_path, [tier("cpu", tmp_path, max_bytes="1MiB", quotas={"default": size - 1})]) as engine:
        store(engine, prompt(0), salt="tenant-a")
        assert engine.metrics.value("kvplug_stores_refused_total", tier="0:cpu", reason="quota") == 1
        assert engine.metrics.value("kvplug_stores_refused_total", tier="0:cpu", reason="pins") == 0


@pytest.fixture
def socket_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="kvpin-"))  # 0700; short: a socket path has ~100 bytes at most
    monkeypatch.setenv("KVPLUG_LOOKUP_DIR", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_ctl_pin_reports_the_pins_a_full_pin_book_refused(tmp_path: Path, socket_dir: Path) -> None:
    tiers = [tier("cpu", tmp_path, max_bytes="1MiB"), tier("disk", tmp_path, max_bytes="1MiB")]
    with make(tmp_path, tiers, tenancy={"max_pins": 4}) as engine:
        server = ControlServer(engine, ControlIdentity("engine-a", "tiny", "test", tp_rank=0, tp_size=1))
        try:
            files = []
            for i in range(2):
                files.append(tmp_path / f"prompt-{i}.txt")
                files[-1].write_text(" ".join(map(str, prompt(i, chunks=4))))

            def ctl(*args: str) -> Any:
                result = CliRunner().invoke(app, ["ctl", *args])
                assert result.exit_code == 0, result.output
                return json.loads(result.output) if "--json" in args else " ".join(result.output.split())

            assert ctl("pin", str(files[0]), "--json")["total"]["missing"] == 4  # pinned when stored
            answer = ctl("pin", str(files[1]), "--json")["total"]  # the book holds 4 keys: full
            assert (answer["refused"], answer["missing"], answer["book_full"]) == (4, 0, 4)
            assert "pin book full (tenancy.max_pins): 4 not pinned when stored" in ctl("pin", str(files[1]))
            store(engine, prompt(1, chunks=4))
            assert [stats.extra["pinned_items"] for _, stats in engine.chain.stats()] == [0, 0]
        finally:
            server.close()
