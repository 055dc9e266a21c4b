"""``kvplug ctl`` against a real SGLang CPU server running kvplug as its HiCache storage backend.

The server is ``python -m sglang.launch_server`` (``kvplug_sglang.testing``); its scheduler's
``KVPlugStorage`` serves a control socket in a private folder made for the test, and
``kvplug ctl`` runs as the real command line. The prompt's page keys are SGLang's own
(``get_hash_str``), so ``lookup`` answers what SGLang's cache controller would find.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplug.core.control.protocol import encode_request as encode_control_request
from kvplug.testing import run_ctl, send_as_other_user
from kvplug_sglang.testing import SGLangServer, hicache_args, write_random_llama

pytestmark = pytest.mark.timeout(900)
PAGE = 64
PROMPT = list(range(100, 100 + 1500))
WHOLE_PAGES = len(PROMPT) // PAGE


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    folder = Path(tempfile.mkdtemp(prefix="kvctl-"))  # 0700, and short: socket paths are ~100 bytes at most
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def server(tmp_path: Path, socket_dir: Path) -> Iterator[SGLangServer]:
    model = write_random_llama(tmp_path / "random-llama")
    args = hicache_args([{"type": "cpu", "max_bytes": "256MiB"}], page_size=PAGE)
    served = SGLangServer(str(model), args, {"KVPLUG_LOOKUP_DIR": str(socket_dir)}, tmp_path / "server.log")
    try:
        yield served.wait_healthy()
    finally:
        served.stop()


def test_ctl_against_an_sglang_server(server: SGLangServer, socket_dir: Path, tmp_path: Path) -> None:
    (rank,) = run_ctl(socket_dir, "list")["ranks"]
    assert rank["adapter"] == "sglang" and rank["tp_size"] == 1 and rank["chunk_size"] == PAGE

    server.generate(PROMPT)
    deadline = time.monotonic() + 120
    while True:  # HiCache backs pages up to its storage backend in the background: poll
        (cpu,) = run_ctl(socket_dir, "stats")["total"]["tiers"]
        if cpu["items"] >= WHOLE_PAGES:
            break
        assert time.monotonic() < deadline, cpu
        time.sleep(0.5)
    assert cpu["tier"] == "0:cpu" and cpu["bytes_used"] > 0

    prompt = tmp_path / "prompt.txt"
    prompt.write_text(" ".join(map(str, PROMPT)))
    looked = run_ctl(socket_dir, "lookup", str(prompt))
    assert looked["total"]["hit_tokens"] == WHOLE_PAGES * PAGE
    assert looked["ranks"][0]["chunks"] == [["cpu", PAGE]] * WHOLE_PAGES
    assert run_ctl(socket_dir, "lookup", str(prompt), "--cache-salt", "other")["total"]["hit_tokens"] == 0

    assert send_as_other_user(Path(rank["socket"]), encode_control_request("info")) == "connect 13"

    pinned = run_ctl(socket_dir, "pin", str(prompt))["total"]
    assert pinned["chunks"] == WHOLE_PAGES and pinned["refused"] == 0 and pinned["bytes"] > 0
    assert pinned["tokens"] == WHOLE_PAGES * PAGE  # the prompt's tokens the pinned pages cover
    (cpu_pinned,) = run_ctl(socket_dir, "tiers")["total"]["tiers"]
    assert cpu_pinned["pinned_bytes"] == pinned["bytes"]
    assert run_ctl(socket_dir, "pin", str(prompt), "--cache-salt", "other")["total"]["missing"] == WHOLE_PAGES
    assert run_ctl(socket_dir, "unpin", str(prompt))["total"]["chunks"] == WHOLE_PAGES

    assert "use --all" in run_ctl(socket_dir, "clear", "--salt", "t", expect_rc=2)
    cleared = run_ctl(socket_dir, "clear", "--all")["total"]
    assert cleared["removed"] == {"0:cpu": cpu["items"]} and cleared["bytes_freed"]["0:cpu"] == cpu["bytes_used"]
    assert run_ctl(socket_dir, "lookup", str(prompt))["total"]["hit_tokens"] == 0
    assert run_ctl(socket_dir, "tiers")["total"]["tiers"][0]["items"] == 0
