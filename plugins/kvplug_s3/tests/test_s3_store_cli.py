"""``kvplug store`` on a real S3 server: list, verify, and clean a tampered object."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from kvplug.testing import key_for, value_for
from kvplug_s3.testing import ACCESS_KEY, BUCKET, SECRET_KEY, make_s3_tier


def kvplug_store(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
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
