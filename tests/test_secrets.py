"""A credential planted in a config never shows in any output.

Secrets are planted in every place a config can hold one (S3 keys, storage_options tokens,
a nested aws_secret_access_key, a password in a URL) and every output is grepped:
``config show``, ``config validate`` errors, exception text, and kvplug's logs while an
engine runs against an S3 endpoint that refuses connections.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import kvplug
from kvplug.errors import ConfigError, ConfigProblem

SECRETS = ("SeCrEt-ONE-4711", "SeCrEt-TWO-4712", "SeCrEt-THREE-4713", "SeCrEt-FOUR-4714", "SeCrEt-FIVE-4715")


def kvplug_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The real CLI app in this process (typer's runner); stdout and stderr as one output."""
    from typer.testing import CliRunner

    from kvplug.cli.console import console, err_console
    from kvplug.cli.main import app

    saved = {name: os.environ.pop(name) for name in ("KVPLUG_PLUGINS", "KVPLUG_CONFIG") if name in os.environ}
    widths = console.width, err_console.width
    console.width = err_console.width = 250  # whole table cells: a secret cannot hide across a line break
    try:
        result = CliRunner().invoke(app, list(args))
    finally:
        os.environ.update(saved)
        console.width, err_console.width = widths
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return subprocess.CompletedProcess(args, result.exit_code, result.output, result.output)


def assert_no_secret(*outputs: str) -> None:
    for output in outputs:
        for secret in SECRETS:
            assert secret not in output, f"{secret} leaked in:\n{output}"


S3_TIER = f"""\
  - type: s3
    url: s3://bucket/prefix
    endpoint_url: http://127.0.0.1:9
    access_key_id: AKIA-{SECRETS[0]}
    secret_access_key: {SECRETS[1]}
    storage_options:
      token: {SECRETS[2]}
      client_kwargs: {{aws_secret_access_key: {SECRETS[3]}}}
      proxy: http://user:{SECRETS[4]}@127.0.0.1:3128
      s3_additional_kwargs: {{SSECustomerAlgorithm: AES256, SSECustomerKey: {SECRETS[0]}}}
"""


def test_config_show_masks_every_credential(tmp_path: Path) -> None:
    path = tmp_path / "kvplug.yaml"
    valkey = f"  - {{type: valkey, url: 'redis://127.0.0.1:6379', username: u, password: {SECRETS[2]}}}\n"
    path.write_text("tiers:\n  - {type: cpu, max_bytes: 1GiB}\n" + S3_TIER + valkey)
    result = kvplug_cli("config", "show", "--file", str(path), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "s3://bucket/prefix" in result.stdout and "127.0.0.1:3128" in result.stdout  # the rest is shown
    assert "**" in result.stdout
    assert_no_secret(result.stdout, result.stderr)


@pytest.mark.parametrize(
    "tier",
    [
        # keys must go together: pydantic's error carries the whole tier mapping as its input
        f"  - {{type: s3, url: 's3://b/p', secret_access_key: {SECRETS[1]}, storage_options: {{token: {SECRETS[2]}}}}}\n",
        # a wrong type echoes the value
        f"  - {{type: s3, url: 's3://b/p', access_key_id: [{SECRETS[0]}], secret_access_key: [{SECRETS[1]}]}}\n",
        f"  - {{type: s3, url: 's3://b/p', storage_options: {SECRETS[2]}}}\n",
        # a password inside the endpoint URL is refused, and not echoed
        f"  - {{type: s3, url: 's3://b/p', endpoint_url: 'http://u:{SECRETS[4]}@127.0.0.1:9'}}\n",
        # valkey: a password in the server URL, and a password of the wrong type
        f"  - {{type: valkey, url: 'redis://:{SECRETS[4]}@127.0.0.1:6379/0'}}\n",
        f"  - {{type: valkey, url: 'redis://127.0.0.1:6379', password: [{SECRETS[1]}]}}\n",
        # a password inside a URL in an unknown key
        f"  - {{type: cpu, redis: 'redis://:{SECRETS[4]}@127.0.0.1:6379/0'}}\n",
    ],
)
def test_validation_errors_mask_every_credential(tmp_path: Path, tier: str) -> None:
    path = tmp_path / "kvplug.yaml"
    path.write_text("tiers:\n" + tier)
    result = kvplug_cli("config", "validate", str(path), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert "tiers[0]" in result.stderr
    assert_no_secret(result.stdout, result.stderr)
    with pytest.raises(ConfigError) as info:
        kvplug.load_config(config_file=path, env={})
    assert_no_secret(str(info.value), repr(info.value), repr(info.value.problems))


def test_redaction_helpers() -> None:
    assert kvplug.redact_url("redis://:pw-123@127.0.0.1:6379/0") == "redis://:***@127.0.0.1:6379/0"
    assert kvplug.redact_url("http://user:pw@127.0.0.1:9000/x?a=1") == "http://user:***@127.0.0.1:9000/x?a=1"
    assert kvplug.redact_url("http://127.0.0.1:9000") == "http://127.0.0.1:9000"
    assert kvplug.redact_url("s3://bucket/p?X-Amz-Signature=abc&x=1") == "s3://bucket/p?X-Amz-Signature=***&x=1"
    assert kvplug.is_secret_name("aws_secret_access_key") and kvplug.is_secret_name("password")
    assert kvplug.is_secret_name("token") and kvplug.is_secret_name("key") and kvplug.is_secret_name("integrity_key")
    assert not kvplug.is_secret_name("max_bytes") and not kvplug.is_secret_name("key_prefix")
    # Foreign options in camelCase: boto3's SSE-C key, an id and key, an Azure connection string's key.
    assert kvplug.is_secret_name("SSECustomerKey") and kvplug.is_secret_name("accessKeyId")
    assert not kvplug.is_secret_name("SSECustomerAlgorithm") and not kvplug.is_secret_name("maxKeys")
    assert "k3y" not in kvplug.redact_text("AccountName=a;AccountKey=k3y;EndpointSuffix=x")
    data = {"url": "valkey://u:pw@127.0.0.1", "password": "pw", "nested": [{"api_key": "k", "size": 3}]}
    assert kvplug.redact(data) == {
        "url": "valkey://u:***@127.0.0.1",
        "password": kvplug.SECRET_MASK,
        "nested": [{"api_key": kvplug.SECRET_MASK, "size": 3}],
    }
    text = "cannot reach redis://:pw@127.0.0.1:6379 (password=pw2, token: tk)"
    assert "pw" not in kvplug.redact_text(text).replace("password", "")
    assert "tk" not in kvplug.redact_text(text)
    problem = ConfigProblem("tiers[0].password", "hunter2", "too short")
    assert "hunter2" not in str(problem) + repr(problem)


def test_logs_and_exceptions_of_a_running_engine_mask_credentials(tmp_path: Path) -> None:
    """An engine with the s3 tier on a port nobody listens on: every warning and error is grepped."""
    path = tmp_path / "kvplug.yaml"
    path.write_text(
        "chunk_size: 8\nstore: {queue: {mode: sync}}\ntiers:\n"
        + S3_TIER.replace(
            "http://127.0.0.1:9\n", "http://127.0.0.1:9\n    retries: 0\n    connect_timeout_s: 0.5\n"
        ).replace(f"      proxy: http://user:{SECRETS[4]}@127.0.0.1:3128\n", "")
    )
    script = textwrap.dedent(
        f"""
        import logging, sys, torch
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout)
        for noisy in ("botocore", "aiobotocore", "s3fs", "fsspec", "urllib3", "asyncio"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        from kvplug import CacheEngine, Fingerprint, KVLayout, PagedFormat, load_config
        flash = PagedFormat("vllm_flash", ("kv", "block", "token", "head", "dim"))
        layout = KVLayout(flash, num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)
        config = load_config(config_file={str(path)!r}, env={{}}).config
        logging.getLogger("kvplug").info("config %r", config)
        caches = [torch.randn(2, 16, 4, 2, 8).to(torch.bfloat16) for _ in range(2)]
        try:
            with CacheEngine(config, layout, Fingerprint.for_layout(layout, model_id="m")) as engine:
                engine.store(list(range(32)), caches, torch.arange(32))
                engine.flush()
                print("hit", engine.lookup(list(range(32))))
        except Exception as exc:
            print("exception", type(exc).__name__, exc)
            raise
        """
    )
    env = dict(os.environ)
    env.pop("KVPLUG_PLUGINS", None)
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert "hit" in result.stdout or "exception" in result.stdout, result.stderr
    assert_no_secret(result.stdout, result.stderr)


def test_config_show_says_whether_records_are_signed_never_the_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplug.core.records.frame import set_integrity_key

    monkeypatch.setenv("KVPLUG_INTEGRITY_KEY", SECRETS[0] * 2)
    set_integrity_key(...)
    try:
        result = kvplug_cli("config", "show", cwd=Path.cwd())
    finally:
        monkeypatch.delenv("KVPLUG_INTEGRITY_KEY")
        set_integrity_key(...)
    assert result.returncode == 0, result.stdout
    row = next(line for line in result.stdout.splitlines() if "integrity_key" in line)
    assert "records are signed" in row and "env KVPLUG_INTEGRITY_KEY" in row
    assert_no_secret(result.stdout)
