"""Who may pin: request pins are off unless the operator turns them on, and then held to
their tenant's quota and request pin budget; the pin book is bounded and says when it
refuses. A real engine with a real cpu and disk tier, configured through load_config."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, random_caches

from kvplug import CacheEngine, Fingerprint, RequestInfo, Tenancy, TierChain, TierContext, load_config
from kvplug.core.pins import pin_keys
from kvplug.core.tenancy import PinBook
from kvplug_cpu import CPUTier

LAYOUT = LAYOUTS["vllm_flash"]
SYSTEM = list(range(5000, 5032))  # 4 chunks of 8 tokens
CACHES = random_caches(LAYOUT, 16)
PIN = {"pin_request": True}  # what an engine adapter makes of a request's pin flag (vLLM: kvplug.pin)


def prompt(i: int) -> list[int]:
    return [100_000 + 1000 * i + t for t in range(32)]


def make(tmp_path: Path, tier_options: dict[str, Any] | None = None, **extra: Any) -> CacheEngine:
    options = {"max_bytes": "64KiB", **(tier_options or {})}
    tiers = [{"type": "cpu", **options}, {"type": "disk", "path": str(tmp_path / "disk"), **options}]
    settings = {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers, **extra}
    config = load_config(engine_extra={"kvplug": settings}, env={}).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="pins"))


def store(engine: CacheEngine, tokens: list[int], salt: str | None = None, pin: bool = False) -> None:
    engine.store(tokens, CACHES, torch.arange(32), request=RequestInfo(cache_salt=salt, overrides=PIN if pin else {}))
    engine.flush()  # the disk tier writes behind a queue


def extras(engine: CacheEngine) -> list[dict[str, Any]]:
    return [stats.extra for _, stats in engine.chain.stats()]


def test_request_pins_are_off_by_default_ignored_counted_and_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with make(tmp_path) as engine, caplog.at_level(logging.WARNING, logger="kvplug.pins"):
        for i in range(3):
            store(engine, prompt(i), salt="tenant-a", pin=True)
        assert [extra["pinned_items"] for extra in extras(engine)] == [0, 0]
        assert engine.lookup(prompt(0), request=RequestInfo(cache_salt="tenant-a")) == 32  # stored as usual
        assert engine.metrics.value("kvplug_request_pins_ignored_total") == 3
        lines = [r.getMessage() for r in caplog.records if "request pins are off" in r.getMessage()]
        assert len(lines) == 1 and "tenancy.request_pins" in lines[0]  # once, not once per request


def test_request_pins_count_against_the_tenant_s_quota_and_request_pin_budget(tmp_path: Path) -> None:
    tier_options = {"pin_max_bytes": "50%", "request_pin_max_bytes": "10%", "quotas": {"acme": "25%"}}
    tenancy = {"request_pins": True, "tenants": {"acme": "acme-secret"}}
    with make(tmp_path, tier_options, tenancy=tenancy) as engine:
        for i in range(30):  # the tenant pins everything it stores: 120 chunks, ~190 KiB
            store(engine, prompt(i), salt="acme-secret", pin=True)
        for extra in extras(engine):
            assert 0 < extra["request_pinned_bytes"] <= 64 * 1024 // 10
            assert extra["tenant_bytes:acme"] <= 64 * 1024 // 4  # pinned chunks included
        # The operator's pins still have the room pin_max_bytes keeps for them.
        store(engine, SYSTEM)
        report = engine.pin(SYSTEM)
        assert (report.chunks, report.refused, report.missing, report.book_full) == (4, 0, 0, 0)


def test_an_operator_pin_turns_request_pins_back_into_ordinary_chunks(tmp_path: Path) -> None:
    tier_options = {"pin_max_bytes": "20%", "request_pin_max_bytes": "20%"}
    with make(tmp_path, tier_options, tenancy={"request_pins": True}) as engine:
        for i in range(6):  # request pins spend all of pin_max_bytes
            store(engine, prompt(i), salt="acme", pin=True)
        assert all(extra["pins_refused"] > 0 for extra in extras(engine))
        store(engine, SYSTEM)
        report = engine.pin(SYSTEM)
        assert (report.chunks, report.refused) == (4, 0)
        for extra in extras(engine):
            assert extra["request_pins_demoted"] >= 4
            assert extra["pinned_bytes"] <= 64 * 1024 // 5


def test_a_full_pin_book_refuses_operator_pins_and_says_why(tmp_path: Path) -> None:
    with make(tmp_path, tenancy={"max_pins": 4}) as engine:
        assert engine.pin(prompt(0)).missing == 4  # remembered: pinned when stored
        report = engine.pin(SYSTEM)  # the book is full
        assert (report.chunks, report.refused, report.missing, report.book_full) == (0, 4, 0, 4)
        assert engine.metrics.value("kvplug_pin_book_full_total", origin="operator") == 4
        store(engine, SYSTEM)
        store(engine, prompt(0))
        assert [extra["pinned_items"] for extra in extras(engine)] == [4, 4]  # prompt 0's chunks only
        # Chunks held now are pinned even so; the report says they will not be when stored again.
        report = engine.pin(SYSTEM)
        assert (report.chunks, report.refused, report.missing, report.book_full) == (4, 0, 0, 4)


def test_in_a_full_pin_book_new_pins_displace_request_pins_and_only_operator_pins_refuse(tmp_path: Path) -> None:
    tier_options = {"pin_max_bytes": "50%", "request_pin_max_bytes": "50%"}
    with make(tmp_path, tier_options, tenancy={"request_pins": True, "max_pins": 4}) as engine:
        store(engine, prompt(0), salt="acme", pin=True)  # 4 request pins fill the book
        store(engine, prompt(1), salt="acme", pin=True)  # they take the places of the first 4
        assert [extra["pinned_items"] for extra in extras(engine)] == [8, 8]  # both stay pinned where held
        report = engine.pin(SYSTEM)  # an operator's pin takes the request pins' places
        assert (report.refused, report.missing, report.book_full) == (0, 4, 0)
        store(engine, prompt(2), salt="acme", pin=True)  # the book holds operator pins only: refused
        assert engine.metrics.value("kvplug_pin_book_full_total", origin="request") == 4
        assert [extra["pinned_items"] for extra in extras(engine)] == [8, 8]
        store(engine, SYSTEM)
        assert [extra["pinned_items"] for extra in extras(engine)] == [12, 12]


def test_a_full_pin_book_does_not_promise_a_pin_it_will_not_keep() -> None:
    tenancy = Tenancy(pins=PinBook(max_keys=4))
    tier = CPUTier(CPUTier.Config(max_bytes=10_000), TierContext(tenancy=tenancy))
    chain = TierChain([tier])
    chain.tenancy = tenancy
    assert pin_keys(chain, [f"v1/fp/{i}" for i in range(4)]).missing == 4  # remembered: pinned when stored
    later = [f"v1/fp/{i}" for i in range(4, 8)]
    report = pin_keys(chain, later)
    assert (report.refused, report.missing) == (4, 0)  # not "missing": they would never be pinned
    tier.put([(key, b"x" * 100) for key in later])
    assert tier.stats().extra["pinned_items"] == 0
