"""A ``cache_salt`` is a tenant's isolation secret: it never becomes a metrics label or a
stats key. Tenants carry the names the operator gives them (``tenancy.tenants``), an
unnamed salt a quota counts apart a keyed digest, every other salt ``(other)``. Scraped
from a real engine's Prometheus registry (what ``metrics_port`` and vLLM's /metrics show)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from core_helpers import LAYOUTS, random_caches
from prometheus_client import generate_latest

from kvplug import CacheEngine, Fingerprint, RequestInfo, load_config
from kvplug.core.tenants import TenantLabels
from kvplug.errors import ConfigError

LAYOUT = LAYOUTS["vllm_flash"]
CACHES = random_caches(LAYOUT, 16)
NAMED, QUOTA_ONLY, UNNAMED = "Zq9-named-tenant-salt", "Xk4-quota-salt", "Wm7-other-salt"


def make(tmp_path: Path, quotas: dict[str, Any], **extra: Any) -> CacheEngine:
    tiers = [
        {"type": "cpu", "max_bytes": "1MiB", "quotas": quotas},
        {"type": "disk", "path": str(tmp_path / "disk"), "max_bytes": "1MiB", "quotas": quotas},
    ]
    settings = {"chunk_size": 8, "store": {"queue": {"mode": "sync"}}, "tiers": tiers, **extra}
    config = load_config(engine_extra={"kvplug": settings}, env={}).config
    return CacheEngine(config, LAYOUT, Fingerprint.for_layout(LAYOUT, model_id="labels"))


def store_and_read(engine: CacheEngine, salts: list[str]) -> str:
    for i, salt in enumerate(salts):
        tokens = [1000 * i + t for t in range(32)]
        engine.store(tokens, CACHES, torch.arange(32), request=RequestInfo(cache_salt=salt))
        engine.flush()
        engine.retrieve(tokens, CACHES, torch.arange(32), request=RequestInfo(cache_salt=salt))
    return generate_latest(engine.metrics.registry).decode()


def test_a_salt_named_in_quotas_never_becomes_a_metric_label(tmp_path: Path) -> None:
    with make(tmp_path, {QUOTA_ONLY: "20%", "default": "10%"}) as engine:
        text = store_and_read(engine, [QUOTA_ONLY, UNNAMED])
        extras = [stats.extra for _, stats in engine.chain.stats()]
    assert "kvplug_tenant_bytes{" in text
    for salt in (QUOTA_ONLY, UNNAMED):
        assert salt not in text
        assert not any(salt in key for extra in extras for key in extra)
    assert 'tenant="salt-' in text and 'tenant="(other)"' in text


def test_tenants_are_labelled_by_the_names_the_operator_gives_them(tmp_path: Path) -> None:
    quotas = {"acme": "30%", QUOTA_ONLY: "20%", "default": "10%"}
    with make(tmp_path, quotas, tenancy={"tenants": {"acme": NAMED}}) as engine:
        text = store_and_read(engine, [NAMED, QUOTA_ONLY, UNNAMED])
        assert engine.chain.stats()[0][1].extra["tenant_bytes:acme"] > 0  # the quota named "acme" is the salt's
        shown = repr(engine.config) + str(engine.config.effective())
    for salt in (NAMED, QUOTA_ONLY, UNNAMED):
        assert salt not in text
    assert NAMED not in shown  # the salts of tenancy.tenants are secrets: config show and reprs mask them
    held = [line for line in text.splitlines() if line.startswith("kvplug_tenant_bytes{")]
    for label in ('tenant="acme"', 'tenant="(other)"', 'tenant="salt-'):
        for tier in ('tier="0:cpu"', 'tier="1:disk"'):
            assert any(label in line and tier in line for line in held), (label, tier, held)
    assert 'tenant="acme"' in text.split("kvplug_tenant_hits_total", 1)[1]


def test_a_digest_label_is_keyed() -> None:
    one, same, other = TenantLabels(key=b"k" * 32), TenantLabels(key=b"k" * 32), TenantLabels(key=b"j" * 32)
    label = one.label(QUOTA_ONLY, {QUOTA_ONLY})
    assert label.startswith("salt-") and QUOTA_ONLY not in label
    assert same.label(QUOTA_ONLY, {QUOTA_ONLY}) == label  # one key (a deployment's): one label
    assert other.label(QUOTA_ONLY, {QUOTA_ONLY}) != label  # no key, no way to match a list of salts against it


@pytest.mark.parametrize(
    ("tenants", "words"),
    [
        ({"acme": "acme"}, ["tenants['acme']", "the name is the salt itself"]),
        ({"default": "s1"}, ["'default' is not a tenant name"]),
        ({"a b": "s1"}, ["'a b' is not a tenant name"]),
        ({"salt-x": "s1"}, ["'salt-x' is not a tenant name"]),
        ({"a": "s1", "b": "s1"}, ["'a' and 'b' have the same cache_salt"]),
        ({"a": ""}, ["tenants['a']: the cache_salt is empty"]),
    ],
)
def test_bad_tenant_names_are_refused_by_name(tenants: dict[str, str], words: list[str]) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(engine_extra={"kvplug": {"tenancy": {"tenants": tenants}}}, env={})
    for word in words:
        assert word in str(caught.value)
    for salt in tenants.values():
        assert f": '{salt}'" not in str(caught.value)  # an error never quotes a salt either


def test_a_folder_tiers_tenant_bytes_in_the_folder_are_labelled_too(tmp_path: Path) -> None:
    """Tier ``disk`` also reports each tenant's bytes in its folder (every process's records:
    what its quota bounds), labelled like the rest; in one process they are its own bytes."""
    quotas = {"acme": "30%", QUOTA_ONLY: "20%"}
    with make(tmp_path, quotas, tenancy={"tenants": {"acme": NAMED}}) as engine:
        text = store_and_read(engine, [NAMED, QUOTA_ONLY])
        extra = engine.chain.stats()[1][1].extra
    assert extra["folder_tenant_bytes:acme"] == extra["tenant_bytes:acme"] > 0
    folder = [line for line in text.splitlines() if line.startswith("kvplug_folder_tenant_bytes{")]
    assert any('tenant="acme"' in line and 'tier="1:disk"' in line for line in folder), folder
    assert any('tenant="salt-' in line for line in folder), folder
    assert not any(salt in text for salt in (NAMED, QUOTA_ONLY))
