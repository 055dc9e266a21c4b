"""Across processes: a value stored by one process is read by another; a writer
killed with SIGKILL mid-put leaves whole values or nothing."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from s3_writer import VERSIONS, version_value

from kvplug.testing import key_for, tier_context, value_for
from kvplug_s3 import S3Tier
from kvplug_s3.testing import s3_options

WRITER = str(Path(__file__).with_name("s3_writer.py"))


def url_options(kind: str, moto_s3, tmp_path: Path) -> dict:
    if kind == "s3":
        return s3_options(moto_s3.endpoint)
    return {"url": f"file://{tmp_path}/store"}


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_another_process_reads_what_one_stored(kind: str, moto_s3, tmp_path: Path) -> None:
    options = url_options(kind, moto_s3, tmp_path)
    done = subprocess.run(
        [sys.executable, WRITER, json.dumps(options), "store", "12"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["stored", "12"]
    tier = S3Tier(S3Tier.Config(**options), tier_context())
    tier.flush()
    keys = [key_for(f"p{i}") for i in range(12)]
    assert [bytes(v) for v in tier.get(keys)] == [value_for(f"p{i}", 3000 + i) for i in range(12)]
    assert tier.stats().items == 12
    tier.close()


@pytest.mark.parametrize("kind", ["s3", "file"])
def test_writer_killed_mid_put_leaves_whole_values_or_nothing(kind: str, moto_s3, tmp_path: Path) -> None:
    options = url_options(kind, moto_s3, tmp_path)
    writer = subprocess.Popen(
        [sys.executable, WRITER, json.dumps(options), "overwrite"], stdout=subprocess.PIPE, text=True
    )
    try:
        puts = 0
        for line in writer.stdout:  # let it write for a while, then kill it wherever it is
            puts = int(line) + 1
            if puts >= 30:
                break
        time.sleep(random.uniform(0, 0.02))  # somewhere inside one of the next puts
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(30)
    assert writer.returncode == -signal.SIGKILL and puts >= 30

    tier = S3Tier(S3Tier.Config(**options), tier_context())
    keys = [key_for(f"o{i}") for i in range(4)]
    got = tier.get(keys)
    for key, value in zip(keys, got):
        assert value is not None, "every key was written whole at least once before the kill"
        versions = {version_value(key, v) for v in range(VERSIONS)}
        assert bytes(value) in versions
    assert tier.stats().extra["corrupt"] == 0
    tier.close()
