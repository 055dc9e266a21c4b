"""The ``kvplug`` command line, run as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def kvplug(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, COLUMNS="400", **(env or {}))
    full_env.pop("KVPLUG_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", *args], env=full_env, capture_output=True, text=True, timeout=300
    )


def test_python_m_kvplug_is_the_kvplug_command() -> None:
    # Where no console script is on PATH (a venv not activated), ``python -m kvplug`` is the command.
    result = subprocess.run(
        [sys.executable, "-m", "kvplug", "--help"],
        env=dict(os.environ, COLUMNS="400"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "Usage: kvplug [OPTIONS] COMMAND" in result.stdout
    assert all(command in result.stdout for command in ("plugins", "config", "store", "ctl"))


def test_config_show_names_where_each_value_came_from(tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("chunk_size: 128\ntiers: [{type: cpu, max_bytes: 1GiB}]\n")
    result = kvplug("config", "show", env={"KVPLUG_CONFIG": str(config), "KVPLUG_HASH": "blake3"})
    assert result.returncode == 0, result.stderr
    rows = {
        line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:4]]
        for line in result.stdout.splitlines()
        if line.count("│") >= 4
    }
    assert rows["chunk_size"] == ["128", f"file {config}"]
    assert rows["hash"] == ["blake3", "env"]
    assert rows["store.queue.mode"] == ["async", "default"]
    assert rows["tiers"][1] == f"file {config}" and "1073741824" in rows["tiers"][0]


def test_config_show_names_the_layer_that_changed_part_of_a_tier(tmp_path: Path) -> None:
    """The tiers row said only "file ..." when KVPLUG_TIERS__0__MAX_BYTES had changed the file's
    max_bytes: the value shown came from the environment, the source said the file."""
    config = tmp_path / "kvplug.yaml"
    config.write_text("tiers: [{type: cpu, max_bytes: 1GiB}]\n")
    env = {"KVPLUG_CONFIG": str(config), "KVPLUG_TIERS__0__MAX_BYTES": "2GiB"}
    result = kvplug("config", "show", env=env)
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("│ tiers "))
    assert "2147483648" in row and f"file {config}; tiers.0.max_bytes: env" in row, row


def test_config_show_takes_the_file_as_validate_does_or_as_an_option(tmp_path: Path) -> None:
    config = tmp_path / "kvplug.yaml"
    config.write_text("chunk_size: 64\n")
    for args in (["config", "show", str(config)], ["config", "show", "-f", str(config)]):
        result = kvplug(*args)
        assert result.returncode == 0, result.stderr
        assert f"file {config}" in result.stdout
    twice = kvplug("config", "show", str(config), "--file", str(config))
    assert twice.returncode != 0 and "give the config file once" in twice.stderr + twice.stdout


def test_config_validate_accepts_a_good_file_and_names_bad_fields(tmp_path: Path) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(
        "chunk_size: 64\nserializer: {type: raw}\nconnector: {type: torch}\ntiers: [{type: cpu, max_bytes: 512MB}]\n"
    )
    result = kvplug("config", "validate", str(good))
    assert result.returncode == 0 and "ok" in result.stdout and "tiers: cpu" in result.stdout

    bad = tmp_path / "bad.yaml"
    bad.write_text("chunk_size: -1\nstore: {queue: {on_full: explode}}\n")
    result = kvplug("config", "validate", str(bad))
    message = " ".join(result.stderr.split())
    assert result.returncode == 2
    assert f"invalid kvplug config in {bad}:" in message
    assert "chunk_size: Input should be greater than 0; line 1 (got -1)" in message
    assert "store.queue.on_full:" in message and "'explode'" in message


def test_demo_runs_the_synthetic_job_and_checks_every_byte() -> None:
    result = kvplug("demo", "--tokens", "1024", "--engine", "synthetic")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "lookup before store │ 0 hit tokens" in out
    assert "lookup after store │ 1024 hit tokens" in out
    assert "prompt sharing half the prefix │ 512 hit tokens" in out
    assert "KV identical after reload │ yes" in out
    # the tier's records: 4 chunks and the fingerprint's manifest (it said "5 chunks" after storing 4)
    assert "tier 0:cpu │ 5 records (4 chunks + manifest) │" in out
    assert "GB/s" in out


def test_demo_of_a_prompt_that_ends_in_a_partial_chunk_loads_its_whole_chunks_and_passes() -> None:
    # The last 232 tokens are no whole chunk of 256 and are not stored (save_unfull_chunk off): the
    # demo said "768 of 1000 tokens were loaded back: the tiers did not keep the prompt" and failed.
    result = kvplug("demo", "--tokens", "1000", "--engine", "synthetic")
    assert result.returncode == 0, result.stderr
    out = " ".join(result.stdout.split())
    assert "retrieved into other blocks │ 768 tokens" in out
    assert "tier 0:cpu │ 4 records (3 chunks + manifest) │" in out


def test_demo_says_when_the_tiers_kept_nothing_rather_than_that_the_kv_differs() -> None:
    # A tier smaller than one chunk (8 MiB here) keeps none: nothing is loaded back, a miss. The demo said
    # "KV loaded back differs from what was stored", as if a load had written wrong KV.
    result = kvplug(
        "demo",
        "--tokens",
        "1024",
        "--engine",
        "synthetic",
        env={"KVPLUG_TIERS": '[{"type": "cpu", "max_bytes": "1MiB"}]'},
    )
    out = " ".join(result.stdout.split())
    assert "KV identical after reload │ nothing was loaded" in out
    assert "differs" not in result.stderr
    assert "0 of 1024 tokens were loaded back: the tiers did not keep the prompt" in result.stderr
    assert result.returncode == 1


def test_every_command_of_a_group_is_summed_up_in_one_line() -> None:
    # A summary is a docstring's first paragraph, printed with its own line breaks: `kvplug store
    # --help` gave verify and gc five ragged lines each, `kvplug ctl --help` stats, tiers and clear
    # two to four (a row that goes on under the command's name).
    for group in ([], ["config"], ["store"], ["ctl"]):
        result = kvplug(*group, "--help")
        assert result.returncode == 0, result.stderr
        commands = result.stdout.split("Commands", 1)[1]
        continued = [line.strip("│ ") for line in commands.splitlines()[1:] if line.startswith("│  ")]
        assert not continued, (group, continued)
