"""A bad kvplug config fails a real vLLM start before the model loads, with one clear error.

vLLM 0.32 constructs both connector roles only after loading and profiling the model,
so kvplug checks its config when vLLM builds its own (``kvplug_vllm.config_check``):
``LLM(...)`` and the OpenAI server both stop in the front-end process, before an engine
process starts, with one traceback that ends in the error naming the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import run_process

from kvplug.errors import ConfigError
from kvplug_vllm.config_check import check_kv_transfer_config, kvplug_extra_configs

BAD_TIERS = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "nosuch"}]
ERROR_LINES = [
    "kvplug.errors.ConfigError: invalid kvplug config:",
    "  - tiers[1].type: unknown tier type 'nosuch'; installed: ",
]
#: Lines vLLM logs once it starts an engine or loads a model.
ENGINE_LINES = ("Initializing a V1 LLM engine", "Starting to load model", "Loading weights", "EngineCore")

LLM_SCRIPT = """
import json, sys
from vllm import LLM
LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, kv_transfer_config=json.loads(sys.argv[2]))
"""


def kv(extra: dict[str, Any]) -> dict[str, Any]:
    return {"kv_connector": "KVPlugConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def assert_one_clear_error(output: str, source: Path | None = None) -> None:
    """One traceback, ending with the config error (naming the config file ``source`` it is
    in, if any); no engine was started."""
    assert output.count("Traceback (most recent call last)") == 1, output[-6000:]
    assert output.count("tiers[1].type") == 1, output[-6000:]
    last = output.rstrip().splitlines()[-2:]
    first = ERROR_LINES[0] if source is None else ERROR_LINES[0].replace("config:", f"config in {source}:")
    assert last[0] == first and last[1].startswith(ERROR_LINES[1]), output[-3000:]
    started = [line for line in output.splitlines() if any(mark in line for mark in ENGINE_LINES)]
    assert not started, "\n".join(started)


def test_llm_with_an_unknown_tier_type_fails_before_the_model_loads(tiny_model: str) -> None:
    config = kv({"kvplug.tiers": BAD_TIERS})
    done = run_process([sys.executable, "-c", LLM_SCRIPT, tiny_model, json.dumps(config)])
    assert done.returncode == 1
    assert_one_clear_error(done.stdout + done.stderr)


def test_llm_with_a_disk_folder_under_a_file_fails_before_the_model_loads(tiny_model: str, tmp_path: Path) -> None:
    """What a tier can tell without opening itself (``StorageTier.preflight``) is checked there too."""
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    tiers = [{"type": "cpu", "max_bytes": "64MiB"}, {"type": "disk", "path": str(blocker / "cache")}]
    done = run_process([sys.executable, "-c", LLM_SCRIPT, tiny_model, json.dumps(kv({"kvplug.tiers": tiers}))])
    assert done.returncode == 1
    output = done.stdout + done.stderr
    assert output.count("Traceback (most recent call last)") == 1, output[-6000:]
    last = output.rstrip().splitlines()[-1]
    assert last.startswith("kvplug.errors.TierOpenError: kvplug config tiers[1] (type disk): cannot open the tier: ")
    assert f"{blocker} is not a folder" in last, last
    assert not [line for line in output.splitlines() if any(mark in line for mark in ENGINE_LINES)]
    assert not (blocker / "cache").exists()


def test_openai_server_with_an_unknown_tier_type_fails_before_the_model_loads(tiny_model: str, tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers:\n  - {type: cpu, max_bytes: 64MiB}\n  - {type: nosuch}\n")
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model,
        "--host", "127.0.0.1", "--port", "0", "--skip-tokenizer-init", "--enforce-eager",
        "--kv-transfer-config", json.dumps(kv({"kvplug.config": str(config)})),
    ]  # fmt: skip
    done = run_process(args, cwd=tmp_path)
    assert done.returncode == 1
    assert_one_clear_error(done.stdout + done.stderr, source=config)


def test_the_check_finds_kvplug_however_it_is_named() -> None:
    class Config:  # the fields of vLLM's KVTransferConfig the check reads
        def __init__(self, **fields: Any) -> None:
            self.kv_connector = fields.get("kv_connector")
            self.kv_connector_module_path = fields.get("kv_connector_module_path")
            self.kv_connector_extra_config = fields.get("kv_connector_extra_config", {})

    bad = {"kvplug.tiers": BAD_TIERS}
    by_name = Config(kv_connector="KVPlugConnector", kv_connector_extra_config=bad)
    by_path = Config(
        kv_connector="KVPlugConnector", kv_connector_module_path="kvplug_vllm.connector", kv_connector_extra_config=bad
    )
    multi = Config(
        kv_connector="MultiConnector",
        kv_connector_extra_config={"connectors": [{"kv_connector": "OffloadingConnector"}, kv(bad)]},
    )
    for config in (by_name, by_path, multi):
        assert list(kvplug_extra_configs(config)) == [bad]
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.type: unknown tier type 'nosuch'"):
            check_kv_transfer_config(config)
    other = Config(kv_connector="OffloadingConnector", kv_connector_extra_config={"kvplug.tiers": BAD_TIERS})
    assert list(kvplug_extra_configs(other)) == []
    check_kv_transfer_config(other)  # not kvplug's: none of its business
    check_kv_transfer_config(None)
    check_kv_transfer_config(
        Config(kv_connector="KVPlugConnector", kv_connector_extra_config={"kvplug.chunk_size": 64})
    )
