"""The check kvplug adds to vLLM's ``EngineArgs.create_engine_config`` (``config_check.install``).

It runs for every vLLM start in a process where kvplug-vllm is installed, so it must
stop a start only for a bad kvplug config. vLLM's real ``EngineArgs`` builds real
configs of a tiny random model here (no engine starts); a stand-in ``create`` stands
only for a vLLM whose config has changed shape, which cannot be caused for real.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.engine.arg_utils import EngineArgs

from kvplug.errors import ConfigError
from kvplug_vllm import config_check


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    config_check.install()


def build(model: str, kv_transfer_config: dict[str, Any] | None) -> Any:
    kv = KVTransferConfig(**kv_transfer_config) if kv_transfer_config is not None else None
    args = EngineArgs(model=model, skip_tokenizer_init=True, enforce_eager=True, kv_transfer_config=kv)
    return args.create_engine_config()


def test_installed_twice_wraps_once() -> None:
    wrapped = EngineArgs.create_engine_config
    config_check.install()
    assert EngineArgs.create_engine_config is wrapped
    assert not getattr(wrapped.__wrapped__, "_kvplug_checks_config", False)  # type: ignore[attr-defined]


def test_a_config_without_a_kv_connector_passes(tiny_model: str) -> None:
    assert build(tiny_model, None).kv_transfer_config is None


def test_another_connectors_config_passes(tiny_model: str) -> None:
    other = {"kv_connector": "ExampleConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"tiers": 1}}
    assert build(tiny_model, other).kv_transfer_config.kv_connector == "ExampleConnector"


def test_a_bad_kvplug_config_raises_from_the_wrapped_method(tiny_model: str) -> None:
    bad = {
        "kv_connector": "KVPlugConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvplug.tiers": [{"type": "nosuch"}]},
    }
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.type: unknown tier type 'nosuch'"):
        build(tiny_model, bad)


def test_a_reset_tier_type_the_config_lacks_is_refused(tiny_model: str) -> None:
    """`kvplug.reset_tiers: ["cpu", "disc"]` (a typo for disk) was accepted, and vLLM's
    reset_prefix_cache then left the disk tier's chunks in place with nothing said."""
    extra = {"kvplug.tiers": [{"type": "cpu"}], "kvplug.reset_tiers": ["cpu", "disc"]}
    bad = {"kv_connector": "KVPlugConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    with pytest.raises(
        ConfigError, match=r"kvplug\.reset_tiers: 'disc' is no tier type of this config \(its tiers: cpu\)"
    ):
        build(tiny_model, bad)
    extra["kvplug.reset_tiers"] = ["cpu"]
    assert build(tiny_model, bad).kv_transfer_config.kv_connector == "KVPlugConnector"


RESHAPED = SimpleNamespace(
    kv_transfer_config=SimpleNamespace(kv_connector="MultiConnector", kv_connector_extra_config=["x"])
)


@pytest.mark.parametrize(
    ("built", "warned"),
    [(SimpleNamespace(), False), (RESHAPED, True)],  # no kv_transfer_config at all: nothing to check
    ids=["attribute-gone", "extra-config-reshaped"],
)
def test_a_vllm_whose_config_changed_shape_still_starts(
    built: Any, warned: bool, caplog: pytest.LogCaptureFixture
) -> None:
    create = config_check.checked(lambda self: built)
    with caplog.at_level(logging.WARNING, logger="kvplug.vllm"):
        assert create(None) is built
    assert ("kvplug could not check vLLM's kv_transfer_config early" in caplog.text) is warned
