"""Config of tier ``s3``: URL checks with clear messages, options, secrets, plugin entry point."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from pydantic import ValidationError

from kvplug import PluginRegistry, load_config
from kvplug.errors import ConfigError
from kvplug.testing import tier_context
from kvplug_s3 import S3Tier, S3TierConfig
from kvplug_s3.testing import BUCKET, s3_options


def error_of(**options) -> str:
    with pytest.raises(ValidationError) as caught:
        S3TierConfig(**options)
    return str(caught.value)


def test_unknown_protocol_lists_what_fsspec_knows_and_what_is_installed() -> None:
    message = error_of(url="nosuchfs://bucket/prefix")
    assert "unknown fsspec protocol 'nosuchfs'" in message
    known, installed = message.split("fsspec knows:")[1].split("; installed:")
    assert "s3" in known and "gcs" in known and "memory" in known
    assert "s3" in installed and "memory" in installed and "file" in installed


def test_a_known_but_uninstalled_protocol_says_what_to_install() -> None:
    from fsspec.registry import known_implementations

    def missing(spec: dict) -> bool:
        return importlib.util.find_spec(spec["class"].split(".")[0]) is None

    protocol, spec = next((p, s) for p, s in sorted(known_implementations.items()) if "err" in s and missing(s))
    message = error_of(url=f"{protocol}://bucket/prefix")
    assert f"protocol {protocol!r} is not installed" in message
    assert spec["err"] in message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("/var/cache/kv", "url needs a protocol, e.g. s3://bucket/prefix or file:///var/cache/kv"),
        ("s3://", "an s3 url names a bucket"),
        ("file://relative/path", "a file url needs an absolute path"),
        ("memory://", "names no location"),
        ("https://example.com/kv", "cannot store objects"),
        ("simplecache::s3://bucket/p", "chained fsspec URLs"),
        ("s3://AKIAEXAMPLE:s3cr3t-Value@bucket/p", "url must not carry credentials (user:password@)"),
        ("memory://user:s3cr3t-Value@host/p", "url must not carry credentials (user:password@)"),
    ],
)
def test_bad_urls_are_named(url: str, expected: str) -> None:
    assert expected in error_of(url=url)


def test_an_s3_prefix_too_long_for_the_object_names_is_refused(moto_s3) -> None:
    # S3 keys hold at most 1024 bytes (AWS answers KeyTooLongError; moto does not check):
    # <prefix>/<xx>/<64-hex digest> must fit, or every store of the tier fails.
    longest = "p" * 956  # names of exactly 1024 bytes
    assert "at most 956 bytes (got 957)" in error_of(url=f"s3://bucket/{longest}q/")  # (a trailing / goes)
    assert "at most 956 bytes (got 958)" in error_of(url=f"s3://bucket/{'é' * 479}")  # UTF-8 bytes count
    tier = S3Tier(S3Tier.Config(**s3_options(moto_s3.endpoint, longest)), tier_context())
    try:
        tier.put([("k", b"v" * 100)])
        (name,) = [o["Key"] for o in moto_s3.client().list_objects_v2(Bucket=BUCKET, Prefix=longest)["Contents"]]
        assert len(name.encode()) == 1024
        assert [bytes(v or b"") for v in tier.get(["k"])] == [b"v" * 100]
    finally:
        tier.close()


def test_s3_options_on_another_protocol_are_errors() -> None:
    message = error_of(url="memory://x", endpoint_url="http://127.0.0.1:9000", region="eu-west-1")
    assert "endpoint_url, region only apply to s3:// URLs" in message


def test_keys_go_together_and_endpoint_is_http() -> None:
    assert "set both or neither" in error_of(url="s3://b/p", access_key_id="AKIA")
    assert "endpoint_url must be an http:// or https:// URL" in error_of(url="s3://b/p", endpoint_url="127.0.0.1:9000")


def test_retries_are_bounded_and_unknown_keys_rejected() -> None:
    assert "retries" in error_of(url="s3://b/p", retries=100)
    assert "extra" in error_of(url="s3://b/p", bucket="b").lower()


def test_defaults_write_asynchronously_and_secrets_stay_hidden() -> None:
    config = S3TierConfig(url="s3://b/p", access_key_id="AKIA-visible-id", secret_access_key="very-secret-value")
    assert config.queue.mode == "async"
    assert "very-secret-value" not in repr(config) and "very-secret-value" not in str(config.model_dump())
    options = config.filesystem_options()
    assert options["secret"] == "very-secret-value"
    assert options["config_kwargs"]["retries"] == {"total_max_attempts": 1}


def test_storage_options_merge_over_the_generated_ones() -> None:
    config = S3TierConfig(
        url="s3://b/p",
        connect_timeout_s=1.5,
        storage_options={"config_kwargs": {"read_timeout": 99}, "requester_pays": True},
    )
    options = config.filesystem_options()
    assert options["config_kwargs"]["read_timeout"] == 99
    assert options["config_kwargs"]["connect_timeout"] == 1.5
    assert options["requester_pays"] is True


def test_config_errors_name_the_tier_field_path() -> None:
    registry = PluginRegistry(plugin_filter="cpu,s3")
    with pytest.raises(ConfigError) as caught:
        load_config(
            engine_extra={"kvplug.tiers": [{"type": "cpu"}, {"type": "s3", "url": "gopher://x/y"}]},
            env={},
            registry=registry,
        )
    assert "tiers[1].url" in str(caught.value) and "gopher" in str(caught.value)


def test_a_url_with_credentials_is_refused_without_showing_them() -> None:
    """s3fs would take ``key:secret@bucket`` for a bucket's name, then put it in every error and log line."""
    registry = PluginRegistry(plugin_filter="s3")
    with pytest.raises(ConfigError) as caught:
        load_config(
            engine_extra={"kvplug.tiers": [{"type": "s3", "url": "s3://AKIAEXAMPLE:s3cr3t-Value@bucket/p"}]},
            env={},
            registry=registry,
        )
    message = str(caught.value)
    assert "tiers[0].url" in message and "must not carry credentials" in message
    assert "s3cr3t-Value" not in message and "s3cr3t-Value" not in repr(caught.value)


def test_the_plugin_loads_through_its_entry_point() -> None:
    registry = PluginRegistry(plugin_filter="s3")
    assert registry.storage_tiers()["s3"] is S3Tier
    assert "kvplug-s3" in registry.origin("storage_tier", "s3")


def test_the_tier_does_not_import_torch() -> None:
    code = (
        "import sys, kvplug_s3; from kvplug_s3 import S3Tier;"
        "from kvplug.testing import tier_context;"
        "t = S3Tier(S3Tier.Config(url='memory://no-torch/x'), tier_context());"
        "t.put([('k', b'v')]); assert bytes(t.get(['k'])[0]) == b'v'; t.close();"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_protocol_of_fsspec_itself_without_its_dependency_is_not_installed() -> None:
    """sftp, smb, git, ... are modules of fsspec, found whatever their dependency (9729927:
    the config was valid and the tier failed when it opened, after the engine started)."""
    from fsspec.registry import known_implementations

    def missing(spec: dict) -> bool:
        return spec["class"].startswith("fsspec.") and "err" in spec and importlib.util.find_spec(spec["dep"]) is None

    dependencies = {"sftp": "paramiko", "smb": "smbprotocol", "git": "pygit2"}
    specs = {p: {**known_implementations[p], "dep": d} for p, d in dependencies.items()}
    protocol, spec = next((p, s) for p, s in specs.items() if missing(s))
    message = error_of(url=f"{protocol}://host/prefix")
    assert f"protocol {protocol!r} is not installed" in message and spec["err"] in message


@pytest.mark.parametrize("protocol", ["hdfs", "arrow_hdfs"])
def test_hdfs_without_pyarrow_is_not_installed(protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsspec's HDFS module imports pyarrow only when the filesystem is made (ee9bb23: the
    config was valid, and the tier failed when it opened, after the engine started)."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # not importable, where a venv has it too
    message = error_of(url=f"{protocol}://namenode:8020/kvplug")
    assert f"protocol {protocol!r} is not installed" in message and "pyarrow" in message, message
