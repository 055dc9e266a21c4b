"""``kvplug store`` on a real S3 server: list, verify, and clean a tampered object."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

from kvplug.testing import key_for, value_for
from kvplug_s3.testing import ACCESS_KEY, BUCKET, SECRET_KEY, FaultProxy, make_s3_tier


def kvplug_store(*args: str, **variables: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        **variables,
        COLUMNS="250",
        AWS_ACCESS_KEY_ID=ACCESS_KEY,
        AWS_SECRET_ACCESS_KEY=SECRET_KEY,
        AWS_DEFAULT_REGION="us-east-1",
    )
    env.pop("KVPLUG_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "kvplug.cli.main", "store", *args], env=env, capture_output=True, text=True, timeout=180
    )


def test_store_commands_on_s3(moto_s3, s3_client) -> None:
    tier = make_s3_tier(moto_s3.endpoint, "cli")
    tier.put([(key_for(f"k{i}"), value_for(f"k{i}", 1000 + i)) for i in range(4)])
    tier.flush()
    tier.close()
    url, endpoint = f"s3://{BUCKET}/cli", moto_s3.endpoint

    stats = kvplug_store("stats", url, "-o", f"endpoint_url={endpoint}")
    assert stats.returncode == 0, stats.stderr
    assert re.search(r"(│ records\s*│\s*4 │|^records: 4$)", stats.stdout, re.M), stats.stdout

    listing = kvplug_store("ls", url, "-o", f"endpoint_url={endpoint}")
    assert "4 records in" in listing.stdout and listing.stdout.count("opaque value") == 4
    assert kvplug_store("verify", url, "-o", f"endpoint_url={endpoint}").returncode == 0

    objects = s3_client.list_objects_v2(Bucket=BUCKET, Prefix="cli/")["Contents"]
    victim = objects[0]["Key"]
    body = bytearray(s3_client.get_object(Bucket=BUCKET, Key=victim)["Body"].read())
    body[-1] ^= 0x55
    s3_client.put_object(Bucket=BUCKET, Key=victim, Body=bytes(body))

    verify = kvplug_store("verify", url, "-o", f"endpoint_url={endpoint}")
    assert verify.returncode == 1 and f"corrupt: {victim.rsplit('/', 1)[1]}" in verify.stdout
    assert kvplug_store("gc", url, "-o", f"endpoint_url={endpoint}").returncode == 0
    remaining = [o["Key"] for o in s3_client.list_objects_v2(Bucket=BUCKET, Prefix="cli/")["Contents"]]
    assert victim not in remaining and len(remaining) == 3


def planted(s3_client, prefix: str, size: int) -> str:
    """An object of ``size`` zero bytes where a record would be; its digest."""
    digest = hashlib.sha256(f"planted {prefix}".encode()).hexdigest()
    s3_client.put_object(Bucket=BUCKET, Key=f"{prefix}/{digest[:2]}/{digest}", Body=bytes(size))
    return digest


def test_store_commands_read_no_record_past_the_engines_bound(moto_s3, s3_client, tmp_path: Path) -> None:
    """A planted object far larger than any record is reported oversized and never downloaded:
    the bound is the engine's (the config's max_chunk_bytes) or --max-record-bytes."""
    tier = make_s3_tier(moto_s3.endpoint, "bound")
    tier.put([(key_for("k"), value_for("k", 1000))])
    tier.flush()
    tier.close()
    digest = planted(s3_client, "bound", 64 << 20)
    config = tmp_path / "kvplug.yaml"
    config.write_text("max_chunk_bytes: 1MiB\n")  # the engine's bound: 2 x 1 MiB + 1 MiB + a header
    proxy = FaultProxy(moto_s3.port)  # counts the bytes the server sent
    url, option = f"s3://{BUCKET}/bound", f"endpoint_url={proxy.endpoint}"
    try:
        for command, extra in (("verify", ()), ("ls", ()), ("verify", ("--max-record-bytes", "8MiB"))):
            before = proxy.answered_bytes
            result = kvplug_store(command, url, "-o", option, *extra, KVPLUG_CONFIG=str(config))
            assert f"oversized: {digest}" in result.stdout or f"oversized: {67108864} bytes" in result.stdout, (
                result.stdout + result.stderr
            )
            assert result.returncode == (1 if command == "verify" else 0), result.stderr
            assert proxy.answered_bytes - before < 16 << 20  # the 1 KiB record and the listing, not 64 MiB

        # gc keeps a record over a bound tighter than the engine's: an engine may serve it ...
        kept = kvplug_store("gc", url, "-o", option, "--max-record-bytes", "1KiB", KVPLUG_CONFIG=str(config))
        assert kept.returncode == 1 and "removed      │     0" in kept.stdout, kept.stdout + kept.stderr
        assert len(s3_client.list_objects_v2(Bucket=BUCKET, Prefix="bound/")["Contents"]) == 2
        # ... and removes one over the engine's own, without downloading it
        before = proxy.answered_bytes
        removed = kvplug_store("gc", url, "-o", option, KVPLUG_CONFIG=str(config))
        assert removed.returncode == 0 and "removed      │     1" in removed.stdout, removed.stdout + removed.stderr
        assert proxy.answered_bytes - before < 16 << 20
        remaining = [o["Key"] for o in s3_client.list_objects_v2(Bucket=BUCKET, Prefix="bound/")["Contents"]]
        assert len(remaining) == 1 and digest not in remaining[0]
    finally:
        proxy.close()


def test_max_record_bytes_refuses_a_bad_value_naming_it() -> None:
    for bad in ("lots", "-1", "64", "1 PB of it"):
        result = kvplug_store("verify", f"s3://{BUCKET}/none", "--max-record-bytes", bad)
        assert result.returncode == 2, result.stderr
        assert "--max-record-bytes" in result.stderr and repr(bad) in result.stderr, result.stderr


#: Runs ``kvplug ARGS``, then prints the process's peak resident memory (``VmHWM``, in kB).
_PEAK = """
import sys
from kvplug.cli.main import app
try:
    app(sys.argv[1:])
finally:
    print("peak_kb", next(l.split()[1] for l in open("/proc/self/status") if l.startswith("VmHWM")), file=sys.stderr)
"""


def peak_mib(*args: str, **variables: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = dict(os.environ, COLUMNS="250", AWS_ACCESS_KEY_ID=ACCESS_KEY, AWS_SECRET_ACCESS_KEY=SECRET_KEY, **variables)
    env.pop("KVPLUG_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", _PEAK, "store", *args], env=env, capture_output=True, text=True, timeout=300
    )
    found = re.search(r"peak_kb (\d+)", done.stderr)
    assert found, done.stderr
    return done, int(found[1]) / 1024


def test_gc_checks_a_bad_object_again_without_holding_a_copy_of_it(moto_s3, s3_client, tmp_path: Path) -> None:
    """gc removes a bad object only if the store still holds it, which takes a second read:
    that read is counted (an object over the bound) or compared piece by piece (a corrupt
    record), never held beside the first. It held up to the bound (129 MiB here), or a second
    copy of the record, and once more while joining the pieces."""
    config = tmp_path / "kvplug.yaml"
    config.write_text("max_chunk_bytes: 64MiB\n")  # the engine's bound: 129 MiB
    option, variables = f"endpoint_url={moto_s3.endpoint}", {"KVPLUG_CONFIG": str(config)}
    over = planted(s3_client, "over", 160 << 20)
    tier = make_s3_tier(moto_s3.endpoint, "rotten")
    tier.put([(key_for("big"), value_for("big", 96 << 20))])
    tier.flush()
    tier.close()
    (rotten,) = [o["Key"] for o in s3_client.list_objects_v2(Bucket=BUCKET, Prefix="rotten/")["Contents"]]
    body = bytearray(s3_client.get_object(Bucket=BUCKET, Key=rotten)["Body"].read())
    body[-1] ^= 0x55
    s3_client.put_object(Bucket=BUCKET, Key=rotten, Body=bytes(body))
    del body

    for prefix, gone in (("over", over), ("rotten", rotten.rsplit("/", 1)[1])):
        url = f"s3://{BUCKET}/{prefix}"
        verified, read_once = peak_mib("verify", url, "-o", option, **variables)  # what reading it (or not) takes
        assert verified.returncode == 1 and gone in verified.stdout, verified.stdout + verified.stderr
        cleaned, with_check = peak_mib("gc", url, "-o", option, **variables)
        assert cleaned.returncode == 0 and re.search(r"│ removed\s*│\s*1 │", cleaned.stdout), cleaned.stdout
        assert "Contents" not in s3_client.list_objects_v2(Bucket=BUCKET, Prefix=f"{prefix}/")
        assert with_check - read_once < 48, (prefix, read_once, with_check)
