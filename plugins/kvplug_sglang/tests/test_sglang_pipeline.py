"""kvplug's radix-cache backend refuses a pipeline-parallel SGLang server (``--pp-size 2``) at start.

Its stages would have to agree on every hit inside ``match_prefix`` on their scheduler threads,
and SGLang's pipeline loop can have a later stage waiting for outputs the first stage sends only
after scheduling its next batch: a stack of the hang this caused showed stage 0 in kvplug's
all_reduce and stage 1 in ``_pp_recv_dict_from_prev_stage``, and the server stopped answering.
A server that does not start, with a message naming the way that works (the HiCache storage
backend, tested at PP 2 in test_sglang_hicache_pipeline.py), is what a user must get instead.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvplug_sglang.testing import SGLangServer, kvplug_env, write_random_llama

pytestmark = pytest.mark.timeout(600)


def test_a_pipeline_parallel_server_with_the_radix_cache_backend_does_not_start_and_says_why(
    tmp_path: Path,
) -> None:
    model = write_random_llama(tmp_path / "model")
    env = {
        **kvplug_env([{"type": "disk", "path": str(tmp_path / "kv")}], chunk_size=64),
        "SGLANG_CPU_OMP_THREADS_BIND": "0|1",  # a core per stage (SGLang otherwise asks a NUMA node each)
    }
    server = SGLangServer(
        str(model), ["--pp-size", "2", "--radix-cache-backend", "kvplug"], env, tmp_path / "log", startup_timeout=300
    )
    try:
        with pytest.raises(RuntimeError, match=r"server on port \d+ exited") as exited:
            server.wait_healthy()
    finally:
        server.stop()
    log = (tmp_path / "log").read_text(errors="replace")
    assert "--radix-cache-backend kvplug does not support pipeline parallelism" in log, exited.value
    assert "kvplug_sglang.hicache.KVPlugStorage" in log
