"""kvplug's HiCache storage backend in a real pipeline-parallel SGLang server (``--pp-size 2``).

Each stage's ``KVPlugStorage`` stores its own layers' pages (``pp_rank`` is in its fingerprint)
and answers ``kvplug ctl`` on a socket of its own. SGLang's cache controller agrees on storage
hits over the TP and pipeline groups itself; here a page one stage cannot load must end as a
recompute on both, never a crash or wrong output.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvplug.testing import run_ctl
from kvplug_sglang.testing import SGLangServer, hicache_args, write_random_llama

pytestmark = pytest.mark.timeout(900)

PAGE = 64
PROMPT = list(range(100, 100 + 4 * PAGE + 8))  # not [10, 11, 12]: SGLang's warm-up request
WHOLE = 4 * PAGE


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[SGLangServer, Path, Path]]:
    """The server, its L3 disk tier's folder and its control sockets' folder."""
    folder = tmp_path_factory.mktemp("hicache-pp")
    sockets, store = folder / "ctl", folder / "l3"
    sockets.mkdir(mode=0o700)
    model = write_random_llama(folder / "model")
    env = {"KVPLUG_LOOKUP_DIR": str(sockets), "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}  # a core per stage
    args = ["--pp-size", "2", *hicache_args([{"type": "disk", "path": str(store)}], page_size=PAGE)]
    server = SGLangServer(str(model), args, env, folder / "log")
    try:
        yield server.wait_healthy(), store, sockets
    finally:
        server.stop()


def lookup(sockets: Path, prompt_file: Path) -> list[int]:
    ranks = run_ctl(sockets, "lookup", str(prompt_file))["ranks"]
    return [r["hit_tokens"] for r in sorted(ranks, key=lambda r: r["pp_rank"])]


def first_page_record(store: Path, fingerprint: str) -> Path:
    """The file of the prompt's first page under one stage's fingerprint (SGLang's page key, as
    its cache controller names it, under kvplug's key prefix)."""
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    (page, *_) = get_hash_str(PROMPT[:WHOLE], storage_namespace_seed(None, None), page_size=PAGE)
    key = f"v1/{fingerprint}/{hashlib.sha256(page.encode()).hexdigest()}"
    digest = hashlib.sha256(key.encode()).hexdigest()
    record = store / digest[:2] / f"{digest}.kvr"
    assert record.is_file(), record
    return record


def test_hicache_pipeline_stages_load_recompute_a_page_one_stage_lost_and_answer_ctl(
    served: tuple[SGLangServer, Path, Path], tmp_path: Path
) -> None:
    server, store, sockets = served
    stages = sorted(run_ctl(sockets, "list")["ranks"], key=lambda r: r["pp_rank"])
    assert [(r["pp_rank"], r["pp_size"]) for r in stages] == [(0, 2), (1, 2)], stages  # each stage answers
    assert stages[0]["fingerprint"] != stages[1]["fingerprint"]  # each stores its own layers' pages

    cold, _, _ = server.generate(PROMPT)
    warm, _, meta = server.generate(PROMPT)  # SGLang's own device cache
    assert meta["cached_tokens"] >= WHOLE, meta
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(" ".join(map(str, PROMPT)))
    deadline = time.monotonic() + 120
    while (hits := lookup(sockets, prompt_file)) != [WHOLE, WHOLE]:  # HiCache backs pages up in the background
        assert time.monotonic() < deadline, hits
        time.sleep(0.5)

    server.flush_cache()
    loaded, _, meta = server.generate(PROMPT)
    assert meta["cached_tokens_details"]["storage"] == WHOLE, meta
    assert loaded == warm

    # stage 1's record of the first page is corrupt: neither stage may use its pages
    record = first_page_record(store, stages[1]["fingerprint"])
    data = record.read_bytes()
    record.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
    server.flush_cache()
    again, _, meta = server.generate(PROMPT)
    assert meta["cached_tokens"] == 0, meta
    assert again == cold

    cleared = run_ctl(sockets, "clear", "--all")["ranks"]
    assert sorted(r["pp_rank"] for r in cleared) == [0, 1] and all(r["removed"]["0:disk"] for r in cleared), cleared
    assert lookup(sockets, prompt_file) == [0, 0]
